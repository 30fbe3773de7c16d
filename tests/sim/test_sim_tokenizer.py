"""The simulator's tokeniser and chat template."""

from kvgate.sim.tokenizer import render_chat, tokenize, tokenize_chat


def test_tokenize_splits_on_any_whitespace():
    assert tokenize("  Hello,\tworld!\n\n foo  ") == ["Hello,", "world!", "foo"]
    assert tokenize("") == []
    assert tokenize(" \n\t") == []


def test_render_chat_template_exact():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    assert render_chat(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_render_chat_tools_first_canonical_json_and_content_parts():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {}},
                                     {"type": "text", "text": "here"}]},
        {"role": "assistant", "content": None},
    ]
    assert render_chat(messages, tools) == (
        '<|im_start|>tools\n[{"function":{"name":"f","parameters":{"a":2,"b":1}},"type":"function"}]<|im_end|>\n'
        "<|im_start|>user\nlook here<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_tokenize_chat_is_deterministic_and_prefix_stable():
    turn1 = [{"role": "system", "content": "sys prompt words"}, {"role": "user", "content": "question one"}]
    turn2 = turn1 + [{"role": "assistant", "content": "answer one"}, {"role": "user", "content": "question two"}]
    a, b = tokenize_chat(turn1), tokenize_chat(turn1)
    assert a == b
    t2 = tokenize_chat(turn2)
    # everything before the generation prompt of turn 1 is a prefix of turn 2
    assert t2[: len(a) - 1] == a[:-1]
    assert a[-1] == "<|im_start|>assistant"
