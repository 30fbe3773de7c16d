"""Guards: reasons to refuse a semantic (or static) candidate whose similarity is above the
threshold, because the two questions differ in what decides the answer.

Embeddings place "enable 2FA" and "disable 2FA", or "order 1234" and "order 1235", closer than
many true paraphrases, so no threshold separates them. :func:`check` compares the two texts on
features an embedding blurs and names the first that differs:

- ``number``: the multisets of numbers (digits, with ``.``/``,`` decimals, and number words
  "one" … "twenty", "hundred", "thousand", …) differ;
- ``date``: the dates or times differ — ISO/US dates, month names, weekdays, years, times of day
  (``10:30``, ``3pm``) and relative days ("today", "tomorrow", "next week", …);
- ``identifier``: identifier-like tokens differ — a token mixing letters and digits (``A12``,
  ``2FA`` matches only ``2FA``), e-mail addresses, URLs, paths, ``#123``, ``snake_case`` or
  ``CamelCase`` names, all-capitals codes of 2+ letters (``SKU``, ``EU``);
- ``negation``: one text is negated and the other not ("not", "n't", "never", "no", "without",
  "cannot", …, counted by parity);
- ``antonym``: one text has a word whose opposite the other has, from a small list of pairs
  (enable/disable, allow/deny, increase/decrease, …) or by a negating prefix
  (``un``/``dis``/``de``/``non``/``in``/``im``/``ir``/``il``: "refundable"/"non-refundable",
  "lock"/"unlock", "subscribe"/"unsubscribe", "possible"/"impossible");
- ``entity``: a proper name (a capitalised word not at the start of a sentence) of one text is
  absent from the other ("Paris" / "Berlin");
- ``script``: either text has a character outside ASCII once typographic punctuation is made
  plain (other scripts, accented words, emoji): the embedding model is English, and its
  tokenizer maps what it cannot read to one unknown token, so "如何启用…" and "如何禁用…", or
  "🔒" and "🔓", embed alike (similarity 1.0). Such text is never answered semantically;
- ``substitution``: the two are a minimal pair — the same words but for one or two swapped
  for others ("open" / "closed", "front" / "back", "after" / "within", "mandatory" /
  "optional") — and the swapped words are neither function words ("can" / "do", "what" /
  "which"), nor forms of one word, nor synonyms from a short list ("shipping" / "delivery"): an
  opposite nobody listed is refused by the shape of the pair, not by a list of opposites;
- ``order``: the same content words in another order ("Celsius to Fahrenheit" / "Fahrenheit to
  Celsius").

Rules are general (features, not remembered sentences): a pair nobody wrote down is judged the
same way. A paraphrase that changes such a feature ("two" vs "2" is the same number) is kept;
one that only rewords never trips a guard.
"""

from __future__ import annotations

import re
from collections import Counter

_NUMBER_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
    "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
    "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19, "twenty": 20, "thirty": 30,
    "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100,
    "thousand": 1000, "million": 1_000_000, "billion": 1_000_000_000, "dozen": 12, "half": 0.5,
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "once": 1, "twice": 2, "double": 2,
    "triple": 3, "single": 1, "couple": 2,
}
_MONTHS = {m: i + 1 for i, m in enumerate(
    "january february march april may june july august september october november december".split())}
_MONTHS.update({m[:3]: i for m, i in list(_MONTHS.items())})
_MONTHS["sept"] = 9
_WEEKDAYS = {d: i for i, d in enumerate("monday tuesday wednesday thursday friday saturday sunday".split())}
_WEEKDAYS.update({d[:3]: i for d, i in list(_WEEKDAYS.items())})
_RELATIVE = {"today", "tonight", "tomorrow", "yesterday", "now", "morning", "afternoon", "evening",
             "night", "weekend", "week", "month", "year", "quarter", "noon", "midnight"}
# (frequencies — "daily", "a day", "weekly" — name no particular day: not dates)
_RELATIVE_MOD = {"next", "last", "this", "previous", "coming", "past"}

_NEGATIONS = {"not", "no", "never", "without", "cannot", "cant", "nobody", "nothing", "none", "neither",
              "nor", "nowhere", "unable", "lack", "lacks",
              "dont", "doesnt", "didnt", "isnt", "arent", "wasnt", "werent", "wont", "wouldnt", "shouldnt",
              "couldnt", "hasnt", "havent", "hadnt", "mustnt", "neednt", "aint", "except", "excluding"}

# Opposites no prefix rule finds. Each pair is symmetric; variants by suffix are matched on a stem.
_ANTONYM_PAIRS = [
    ("enable", "disable"), ("on", "off"), ("allow", "deny"), ("allow", "block"), ("allow", "forbid"),
    ("permit", "forbid"), ("accept", "reject"), ("accept", "decline"), ("approve", "reject"),
    ("approve", "deny"), ("include", "exclude"), ("increase", "decrease"), ("increase", "reduce"),
    ("raise", "lower"), ("up", "down"), ("upgrade", "downgrade"), ("upload", "download"),
    ("import", "export"), ("add", "remove"), ("add", "delete"), ("create", "delete"), ("create", "destroy"),
    ("insert", "delete"), ("open", "close"), ("start", "stop"), ("start", "end"), ("begin", "end"),
    ("login", "logout"), ("log in", "log out"), ("sign in", "sign out"), ("signin", "signout"),
    ("sign up", "cancel"), ("subscribe", "cancel"), ("join", "leave"), ("buy", "sell"), ("buy", "rent"),
    ("before", "after"), ("min", "max"), ("minimum", "maximum"), ("more", "less"), ("more", "fewer"),
    ("most", "least"), ("best", "worst"), ("better", "worse"), ("cheap", "expensive"),
    ("cheapest", "priciest"), ("high", "low"), ("higher", "lower"), ("highest", "lowest"),
    ("large", "small"), ("larger", "smaller"), ("largest", "smallest"), ("big", "small"),
    ("long", "short"), ("longer", "shorter"), ("fast", "slow"), ("faster", "slower"),
    ("early", "late"), ("earlier", "later"), ("first", "last"), ("old", "new"), ("older", "newer"),
    ("oldest", "newest"), ("hot", "cold"), ("true", "false"), ("yes", "no"), ("win", "lose"),
    ("push", "pull"), ("send", "receive"), ("incoming", "outgoing"), ("inbound", "outbound"),
    ("input", "output"), ("in", "out"), ("inside", "outside"), ("internal", "external"),
    ("public", "private"), ("show", "hide"), ("visible", "hidden"), ("mount", "unmount"),
    ("attach", "detach"), ("connect", "disconnect"), ("encrypt", "decrypt"), ("compress", "decompress"),
    ("encode", "decode"), ("serialize", "deserialize"), ("install", "uninstall"), ("install", "remove"),
    ("pass", "fail"), ("success", "failure"), ("succeed", "fail"), ("valid", "invalid"),
    ("legal", "illegal"), ("safe", "unsafe"), ("safe", "dangerous"), ("same", "different"),
    ("always", "never"), ("all", "none"), ("everyone", "nobody"), ("above", "below"), ("over", "under"),
    ("left", "right"), ("north", "south"), ("east", "west"), ("import", "export"), ("lend", "borrow"),
    ("debit", "credit"), ("deposit", "withdraw"), ("income", "expense"), ("profit", "loss"),
    ("gain", "lose"), ("refund", "charge"), ("free", "paid"), ("arrive", "depart"), ("arrival", "departure"),
    ("come", "go"), ("give", "take"), ("sender", "recipient"), ("buyer", "seller"), ("male", "female"),
    ("men", "women"), ("man", "woman"), ("boy", "girl"), ("adult", "child"), ("white", "black"),
    ("light", "dark"), ("lighter", "darker"), ("wet", "dry"), ("full", "empty"), ("easy", "hard"),
    ("easy", "difficult"), ("strong", "weak"), ("rich", "poor"), ("heavy", "light"), ("thick", "thin"),
    ("wide", "narrow"), ("deep", "shallow"), ("positive", "negative"), ("plus", "minus"),
    ("ascending", "descending"), ("asc", "desc"), ("forward", "backward"), ("forwards", "backwards"),
    ("next", "previous"), ("horizontal", "vertical"), ("uppercase", "lowercase"), ("upper", "lower"),
    ("read", "write"), ("sync", "async"), ("synchronous", "asynchronous"), ("client", "server"),
    ("frontend", "backend"), ("import", "export"), ("merge", "split"), ("join", "split"),
    ("freeze", "unfreeze"), ("pause", "resume"), ("online", "offline"), ("remote", "local"),
    ("agree", "disagree"), ("like", "dislike"), ("love", "hate"), ("pros", "cons"),
    ("advantage", "disadvantage"), ("advantages", "disadvantages"), ("benefit", "drawback"),
    ("benefits", "drawbacks"), ("cause", "cure"), ("symptoms", "treatment"), ("prevent", "cause"),
]
_NEGATING_PREFIXES = ("non-", "non", "un", "dis", "de", "in", "im", "ir", "il", "anti-", "anti", "mis")

_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-./@#:']*[A-Za-z0-9]|[A-Za-z0-9]|#\d+")
_WORD = re.compile(r"[a-z]+(?:-[a-z]+)*")
_NUM = re.compile(r"(?<![\w.])[-+]?\$?\d+(?:[.,]\d+)*(?:%|k|m|x)?(?![\w])", re.I)
_ISO_DATE = re.compile(r"\b\d{4}-\d{1,2}-\d{1,2}\b|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b")
_TIME = re.compile(r"\b\d{1,2}(?::\d{2})?\s?(?:am|pm)\b|\b\d{1,2}:\d{2}\b", re.I)
_YEAR = re.compile(r"\b(?:1[5-9]\d\d|2[01]\d\d)s?\b")
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b")
_URL = re.compile(r"\b(?:https?://|www\.)\S+|\b[\w-]+\.(?:com|org|net|io|dev|ai|co|de|fr|uk)\b", re.I)
_PATH = re.compile(r"(?:^|\s)(?:[~.]?/[\w.\-/]+|[\w\-]+\.(?:py|js|ts|json|yaml|yml|csv|txt|md|html|css|"
                   r"sh|go|rs|java|cpp|c|h|sql|log|conf|ini|toml|xml|pdf|docx?|xlsx?|png|jpe?g))\b", re.I)
_CONTRACTIONS = [(re.compile(r"\bcan't\b|\bcannot\b", re.I), "can not"),
                 (re.compile(r"\bwon't\b", re.I), "will not"),
                 (re.compile(r"\b(\w+)n't\b", re.I), r"\1 not"),
                 (re.compile(r"\b(what|where|who|how|when|why|it|that|there|here|this)'s\b", re.I), r"\1 is"),
                 (re.compile(r"\b(\w+)'re\b", re.I), r"\1 are"), (re.compile(r"\b(\w+)'ve\b", re.I), r"\1 have"),
                 (re.compile(r"\b(\w+)'ll\b", re.I), r"\1 will"), (re.compile(r"\bi'm\b", re.I), "i am"),
                 (re.compile(r"\b(\w+)'d\b", re.I), r"\1 would")]


def _words(text: str) -> list[str]:
    t = text.lower().replace("’", "'")
    for rx, repl in _CONTRACTIONS:
        t = rx.sub(repl, t)
    return _WORD.findall(t.replace("'", ""))


def _stem(w: str) -> str:
    for suf in ("ing", "ed", "es", "s", "d"):
        if len(w) > len(suf) + 2 and w.endswith(suf):
            return w[: -len(suf)]
    return w


def numbers(text: str) -> Counter:
    """The numbers in ``text`` as a multiset of floats (digits and number words; dates and times are
    :func:`dates`' and identifiers' numbers are :func:`identifiers`')."""
    t = _ISO_DATE.sub(" ", _TIME.sub(" ", text))
    t = " ".join(w for w in t.split() if not _is_identifier(w.strip(".,;:!?()[]{}\"'")))
    out: Counter = Counter()
    for m in _NUM.finditer(t):
        raw = m.group(0).lower().lstrip("+$").rstrip("%")
        mult = 1.0
        if raw.endswith("k"):
            raw, mult = raw[:-1], 1e3
        elif raw.endswith("m"):
            raw, mult = raw[:-1], 1e6
        elif raw.endswith("x"):
            raw = raw[:-1]
        raw = raw.replace(",", "") if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", raw) else raw.replace(",", ".")
        try:
            val = float(raw) * mult
        except ValueError:
            continue
        if _YEAR.fullmatch(m.group(0)):
            continue  # a year is a date
        out[val] += 1
    for w in _words(t):
        if w in _NUMBER_WORDS and w not in ("second", "once"):  # "a second" / "once" are rarely counts
            out[float(_NUMBER_WORDS[w])] += 1
    return out


def dates(text: str) -> Counter:
    """Dates and times in ``text`` as a multiset of normalised strings (``2024-5-1``,
    ``month:5``, ``day:14``, ``weekday:0``, ``year:2024``, ``time:15:00``, ``rel:next week``)."""
    out: Counter = Counter()
    for m in _ISO_DATE.finditer(text):
        parts = [int(p) for p in re.split(r"[-/.]", m.group(0))]
        out["date:" + "-".join(map(str, parts))] += 1
    for m in _TIME.finditer(text):
        s = m.group(0).lower().replace(" ", "")
        h, _, rest = s.partition(":")
        mins = re.match(r"\d*", rest).group(0) if rest else "00"
        hh = int(re.match(r"\d+", h).group(0))
        if s.endswith("pm") and hh < 12:
            hh += 12
        if s.endswith("am") and hh == 12:
            hh = 0
        out[f"time:{hh}:{mins or '00'}"] += 1
    for m in _YEAR.finditer(text):
        out[f"year:{m.group(0)}"] += 1
    ws = _words(text)
    raw = text.lower()
    for i, w in enumerate(ws):
        if w in _MONTHS and (len(w) > 3 or re.search(rf"\b{w}\b\.?\s*\d", raw)) and w != "may" or \
                (w == "may" and re.search(r"\bmay\s+\d|\d(?:st|nd|rd|th)?\s+(?:of\s+)?may\b|\bin may\b", raw)):
            out[f"month:{_MONTHS[w]}"] += 1
        elif w in _WEEKDAYS and (len(w) > 3 or w in ("mon", "tue", "wed", "thu", "fri", "sat", "sun")):
            if len(w) > 3 or re.search(rf"\b{w}\b", raw):
                out[f"weekday:{_WEEKDAYS[w]}"] += 1
        elif w in _RELATIVE:
            mod = ws[i - 1] if i and ws[i - 1] in _RELATIVE_MOD else ""
            out[f"rel:{mod} {w}".replace(": ", ":")] += 1
    for m in re.finditer(r"\b(\d{1,2})(?:st|nd|rd|th)\b", raw):
        out[f"day:{int(m.group(1))}"] += 1
    return out


def _is_identifier(tok: str) -> bool:
    if len(tok) < 2:
        return False
    if re.fullmatch(r"#\d+", tok) or _EMAIL.fullmatch(tok) or _URL.fullmatch(tok):
        return True
    has_d, has_a = any(c.isdigit() for c in tok), any(c.isalpha() for c in tok)
    if has_d and has_a and not re.fullmatch(r"\d+(?:st|nd|rd|th|s|k|m|x|am|pm|gb|mb|kb|tb|ms|px|%)", tok, re.I):
        return True
    if "_" in tok.strip("_") and has_a:
        return True
    if re.fullmatch(r"[a-z]+[A-Z][A-Za-z]*", tok) or re.fullmatch(r"[A-Z][a-z]+[A-Z][A-Za-z]*", tok):
        return True  # camelCase / CamelCase names
    if re.fullmatch(r"[A-Z]{2,}[A-Z0-9\-]*", tok) and tok not in ("OK", "I", "AM", "PM", "FAQ"):
        return True
    if has_d and re.fullmatch(r"\d+(?:-\d+)+", tok) and not _ISO_DATE.fullmatch(tok):
        return True  # 555-0100, 4111-1111
    return False


def identifiers(text: str) -> Counter:
    """Identifier-like tokens of ``text`` (case kept for codes, lowered for e-mails/URLs)."""
    out: Counter = Counter()
    for m in _EMAIL.finditer(text):
        out["email:" + m.group(0).lower()] += 1
    t = _EMAIL.sub(" ", text)
    for m in _URL.finditer(t):
        out["url:" + m.group(0).lower().rstrip(".,;:!?)")] += 1
    t = _URL.sub(" ", t)
    for m in _PATH.finditer(t):
        out["path:" + m.group(0).strip()] += 1
    t = _PATH.sub(" ", t)
    for tok in re.findall(r"#\d+|[\w][\w\-]*[\w]|\w", t):
        if _is_identifier(tok):
            out["id:" + tok.upper()] += 1
    return out


def negated(text: str) -> bool:
    """Whether ``text`` is negated: an odd count of negation words (double negation cancels)."""
    return sum(1 for w in _words(text) if w in _NEGATIONS) % 2 == 1


_PAIRS: dict[str, set[str]] = {}
for _a, _b in _ANTONYM_PAIRS:
    _PAIRS.setdefault(_a, set()).add(_b)
    _PAIRS.setdefault(_b, set()).add(_a)


def _bases(w: str) -> set[str]:
    """Candidate positive degrees of a comparative/superlative: cheapest → cheap, slower → slow,
    biggest → big (and bigg), easier → easy; empty for other words."""
    for suf in ("est", "er"):
        if len(w) > len(suf) + 3 and w.endswith(suf):
            b = w[: -len(suf)]
            if b.endswith("i"):
                return {b[:-1] + "y"}
            if len(b) > 2 and b[-1] == b[-2] and b[-1] not in "aeiou":
                return {b, b[:-1]}
            return {b}
    return set()


def _phrases(ws: list[str]) -> set[str]:
    out = set(ws) | {_stem(w) for w in ws} | {b for w in ws for b in _bases(w)}
    out |= {f"{a} {b}" for a, b in zip(ws, ws[1:])}
    return out


def antonym(a: str, b: str) -> tuple[str, str] | None:
    """A pair of opposite words, one only in ``a``, the other only in ``b`` (or ``None``)."""
    wa, wb = _words(a), _words(b)
    pa, pb = _phrases(wa), _phrases(wb)
    only_a, only_b = pa - pb, pb - pa
    for x in only_a:
        for y in _PAIRS.get(x, ()):
            if y in only_b:
                return x, y
    for x, y in ((p, q) for p in only_a for q in only_b):
        for pre in _NEGATING_PREFIXES:
            for longer, shorter in ((x, y), (y, x)):
                if longer.startswith(pre) and len(shorter) >= 4 and longer[len(pre):].lstrip("-") == shorter:
                    return x, y
    return None


def entities(text: str) -> set[str]:
    """Proper names: capitalised words (lowered) not at the start of a sentence, and not ``I``."""
    out = set()
    for sent in re.split(r"(?<=[.!?:;])\s+|\n+", text.strip()):
        toks = re.findall(r"[A-Za-z][\w'\-]*", sent)
        for i, tok in enumerate(toks):
            if i and tok[0].isupper() and tok not in ("I", "I'm", "I'd", "I've", "I'll") and \
                    not tok.isupper():
                out.add(tok.lower().split("'")[0])
    return out


_PLAIN = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                        "\u2014": "-", "\u2026": "...", "\u00a0": " ", "\u00bf": "?", "\u00a1": "!"})


def readable(text: str) -> bool:
    """Whether the English embedding model can read ``text``: ASCII once typographic quotes,
    dashes, ellipses and non-breaking spaces are made plain (see ``script`` above)."""
    return text.translate(_PLAIN).isascii()


_FUNCTION = set("""a an the this that these those my your our their his her its i you we they he she it me us
them is are was were be been being am do does did can could would should may might will shall must have has had
how what which who whom whose where when why there here please tell explain show give let any some way ways
get got so just also really actually""".split())
"""Words whose swap does not change what is asked ("How can I" / "How do I", "What" / "Which")."""

_SYNONYMS = [frozenset(g.split("/")) for g in """shipping/delivery/shipment/shipped/delivered/ship/deliver/send
buy/purchase/order cost/price/fee/charge big/large small/little fast/quick/rapid start/begin fix/repair
help/assist/support email/e-mail/mail phone/mobile/cell app/application car/automobile kid/child/children
picture/photo/image movie/film shop/store begin/commence end/finish/complete receive/get/obtain
modify/change/edit/update remove/delete erase/delete choose/select/pick reply/answer/respond
sign/log signin/login signup/register issue/problem error/bug plane/airplane teammate/colleague
with/using/via/through/by""".split()]


def _same_meaning(x: str, y: str) -> bool:
    if x in _FUNCTION and y in _FUNCTION:
        return True
    if _bases(x) & _bases(y):
        return True
    short, long_ = sorted((x, y), key=len)
    common = len(__import__("os").path.commonprefix([x, y]))
    if common >= 4 and common >= len(short) - 3:
        return True  # forms or spellings of one word: invoice/invoices, info/information, color/colour
    bx, by = _bases(x) | {x, _stem(x)}, _bases(y) | {y, _stem(y)}
    return any((bx & g) and (by & g) for g in _SYNONYMS)


def substitution(a: str, b: str) -> tuple[str, str] | None:
    """The first swapped pair of a minimal pair (see ``substitution`` above), else None."""
    import difflib

    wa, wb = _words(a), _words(b)
    if not wa or not wb:
        return None
    sm = difflib.SequenceMatcher(a=wa, b=wb, autojunk=False)
    same = sum(bl.size for bl in sm.get_matching_blocks())
    if same < 0.6 * max(len(wa), len(wb)):
        return None  # a rewording, not a minimal pair
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op != "replace" or i2 - i1 > 2 or j2 - j1 > 2:
            continue
        xs, ys = wa[i1:i2], wb[j1:j2]
        if len(xs) == len(ys):
            for x, y in zip(xs, ys):
                if x != y and not _same_meaning(x, y):
                    return x, y
        elif not any(_same_meaning(x, y) for x in xs for y in ys) and \
                not all(w in _FUNCTION for w in xs + ys):
            return " ".join(xs), " ".join(ys)
    return None


_DIRECTIONAL = {"to", "from", "into", "than", "vs", "versus", "before", "after", "over", "under", "above",
                "below", "or", "and", "onto", "toward", "towards", "against"}


def reordered(a: str, b: str) -> bool:
    """The same content words, moved across a word that gives them a direction or a role
    ("Celsius to Fahrenheit" / "Fahrenheit to Celsius", "A or B" / "B or A"); a reordering
    within one phrase ("the tallest mountain" / "which mountain is the tallest") is not."""
    def segments(t: str) -> tuple[list[Counter], Counter]:
        segs, cur, allw = [], Counter(), Counter()
        for w in _words(t):
            if w in _DIRECTIONAL:
                segs.append(cur)
                cur = Counter()
            elif w not in _FUNCTION:
                cur[w] += 1
                allw[w] += 1
        segs.append(cur)
        return [c for c in segs if c], allw

    sa, ca = segments(a)
    sb, cb = segments(b)
    return len(sa) > 1 and ca == cb and sa != sb


def check(a: str, b: str) -> str | None:
    """The name of the first guard that tells ``a`` and ``b`` apart (``script``, ``number``,
    ``date``, ``identifier``, ``negation``, ``antonym``, ``entity``, ``substitution``, ``order``)
    or ``None`` when none does."""
    if not (readable(a) and readable(b)):
        return "script"
    if numbers(a) != numbers(b):
        return "number"
    if dates(a) != dates(b):
        return "date"
    if identifiers(a) != identifiers(b):
        return "identifier"
    if negated(a) != negated(b):
        return "negation"
    if antonym(a, b):
        return "antonym"
    ea, eb = entities(a), entities(b)
    words_a, words_b = set(_words(a)), set(_words(b))
    if (ea - words_b) or (eb - words_a):
        return "entity"
    if substitution(a, b):
        return "substitution"
    if reordered(a, b):
        return "order"
    return None
