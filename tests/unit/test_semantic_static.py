"""Static answers files (kvgate.semantic.static): YAML and CSV, several phrasings per answer,
the file's own threshold, and errors that name the file and the row or field."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.semantic.static import StaticAnswersError, load_static, normalize


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


def test_yaml_with_phrasings_and_threshold(tmp_path: Path) -> None:
    sa = load_static(write(tmp_path, "faq.yaml", """
similarity_min: 0.87
answers:
  - questions: ["What are your opening hours?", "When are you open?"]
    answer: "9:00-17:00, Monday to Friday."
  - question: Where are you?
    answer: 1 Main Street.
"""))
    assert sa.similarity_min == 0.87
    assert sa.questions == ["What are your opening hours?", "When are you open?", "Where are you?"]
    assert [sa.answers[i] for i in sa.qa] == ["9:00-17:00, Monday to Friday."] * 2 + ["1 Main Street."]
    assert sa.exact[normalize("  when ARE you   open ")] == 1


def test_csv_continuation_rows_and_threshold_comment(tmp_path: Path) -> None:
    sa = load_static(write(tmp_path, "faq.csv", '# support FAQ\n# similarity_min: 0.9\nquestion,answer\n'
                           'How do I reset my password?,"Use the link on the sign-in page, then check your mail."\n'
                           'I forgot my password,\n\nDo you ship abroad?,Yes: to 40 countries.\n'))
    assert sa.similarity_min == 0.9
    assert sa.qa == [0, 0, 1]
    assert sa.answers[0].startswith("Use the link on the sign-in page, then")


@pytest.mark.parametrize("name,text,message", [
    ("a.yaml", "answers:\n  - questions: [a]\n    answer: ''\n", "a.yaml: answers[0].answer: answer must be a non-empty string"),
    ("a.yaml", "answers:\n  - questions: []\n    answer: x\n", "a.yaml: answers[0].questions: a non-empty list"),
    ("a.yaml", "answers:\n  - questions: [a]\n    answer: x\n    tags: [t]\n", "answers[0]: unknown field(s) ['tags']"),
    ("a.yaml", "similarity_min: 0.1\nanswers: []\n", "similarity_min must be a cosine similarity in [0.5, 1.0] (not a distance)"),
    ("a.yaml", "answers:\n  - questions: ['Hi?']\n    answer: x\n  - questions: [hi]\n    answer: y\n",
     "answers[1]: the question 'hi' is already answered differently"),
    ("a.yaml", "answers: [\n", "a.yaml: line 2: not valid YAML"),
    ("a.yaml", "- a\n", "top level: expected a mapping with `answers:`"),
    ("a.csv", "q,a\nx,y\n", "a.csv: line 1: the header must be `question,answer`"),
    ("a.csv", "question,answer\nx,y\nz,w,v\n", "a.csv: row 2 (line 3): expected 2 columns"),
    ("a.csv", "question,answer\nx,\n", "a.csv: row 1 (line 2): an empty answer continues the answer above"),
    ("a.csv", "# similarity_min: 1.5\nquestion,answer\nx,y\n", "a.csv: line 1: similarity_min must be"),
    ("a.csv", "question,answer\n", "a.csv: no answers"),
    ("a.txt", "x", "unknown format '.txt'"),
])
def test_errors_name_the_file_and_the_row(tmp_path: Path, name: str, text: str, message: str) -> None:
    with pytest.raises(StaticAnswersError) as exc:
        load_static(write(tmp_path, name, text))
    assert message in str(exc.value)
    assert str(tmp_path / name) in str(exc.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(StaticAnswersError, match="cannot read"):
        load_static(tmp_path / "nope.yaml")


def test_the_policy_loader_validates_the_file(tmp_path: Path) -> None:
    from kvgate.policy import PolicyError, load_policy

    write(tmp_path, "faq.csv", "question,answer\nWhen are you open?,Always.\nWhere?,x,y\n")
    policy = write(tmp_path, "p.yaml", "version: 1\npools:\n  - name: default\n    models: [m]\n"
                   "    nodes: [{id: n1, url: 'http://127.0.0.1:9'}]\n    semantic: {static_answers: faq.csv}\n")
    with pytest.raises(PolicyError) as exc:
        load_policy(policy)
    assert "pools[0].semantic.static_answers" in str(exc.value)
    assert f"{tmp_path / 'faq.csv'}: row 2 (line 3): expected 2 columns" in str(exc.value)
    write(tmp_path, "faq.csv", "question,answer\nWhen are you open?,Always.\n")
    assert load_policy(policy).pools[0].semantic.static_answers == "faq.csv"
