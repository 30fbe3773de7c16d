"""Static answers: an operator's FAQ file of question → answer pairs, answered by the gateway
(``X-Kvgate-Cache: STATIC``) without an engine.

YAML::

    similarity_min: 0.90          # optional: this file's own cosine similarity threshold [0.5, 1.0]
    answers:
      - questions: ["What are your opening hours?", "When are you open?"]
        answer: "We are open 9:00-17:00, Monday to Friday."

CSV (a header ``question,answer``; ``#`` lines are comments; ``# similarity_min: 0.90`` sets the
threshold; a row with an empty answer is one more phrasing of the answer above it)::

    # similarity_min: 0.90
    question,answer
    What are your opening hours?,"We are open 9:00-17:00, Monday to Friday."
    When are you open?,

A question matches when it equals one of the file's after :func:`normalize` (case, spaces and
trailing punctuation), or by similarity at or above the file's threshold with the same guards as
the semantic cache. Errors (:class:`StaticAnswersError`) name the file and the row or field.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEFAULT_SIMILARITY = 0.90
MAX_ANSWERS = 10_000
MAX_TEXT = 20_000


class StaticAnswersError(ValueError):
    """A static answers file that cannot be used; the message starts with ``<file>: <where>:``."""


def normalize(text: str) -> str:
    """Lower case, one space between words, no surrounding punctuation or spaces."""
    t = re.sub(r"\s+", " ", text.strip().lower().replace("’", "'"))
    return t.strip(" ?!.,;:")


@dataclass
class StaticAnswers:
    """A loaded file: ``questions[i]`` is answered by ``answers[qa[i]]``."""

    path: Path
    similarity_min: float
    questions: list[str] = field(default_factory=list)
    qa: list[int] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    exact: dict[str, int] = field(default_factory=dict)  # normalize(question) -> question index
    vectors: object = None  # numpy (len(questions), dim), set by the service

    def add(self, answer: str, questions: list[str], where: str) -> None:
        ai = len(self.answers)
        self.answers.append(answer)
        for q in questions:
            n = normalize(q)
            if n in self.exact and self.answers[self.qa[self.exact[n]]] != answer:
                raise StaticAnswersError(f"{self.path}: {where}: the question {q!r} is already answered "
                                         f"differently (question {self.questions[self.exact[n]]!r})")
            self.exact.setdefault(n, len(self.questions))
            self.questions.append(q)
            self.qa.append(ai)


def _text(v: object, what: str, path: Path, where: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise StaticAnswersError(f"{path}: {where}: {what} must be a non-empty string, not {v!r}")
    if len(v) > MAX_TEXT:
        raise StaticAnswersError(f"{path}: {where}: {what} is longer than {MAX_TEXT} characters")
    return v.strip()


def _threshold(v: object, path: Path, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.5 <= float(v) <= 1.0:
        raise StaticAnswersError(f"{path}: {where}: similarity_min must be a cosine similarity in "
                                 f"[0.5, 1.0] (not a distance), not {v!r}")
    return float(v)


def load_static(path: str | Path) -> StaticAnswers:
    """Read and validate a YAML (``.yaml``/``.yml``) or CSV (``.csv``) file.

    Raises :class:`StaticAnswersError` (unreadable file, unknown extension, malformed rows,
    empty questions or answers, a question with two different answers, a bad threshold)."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise StaticAnswersError(f"{path}: cannot read: {exc}") from None
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        out = _load_yaml(path, raw)
    elif suffix == ".csv":
        out = _load_csv(path, raw)
    else:
        raise StaticAnswersError(f"{path}: unknown format {suffix!r} (use .yaml, .yml or .csv)")
    if not out.answers:
        raise StaticAnswersError(f"{path}: no answers")
    if len(out.answers) > MAX_ANSWERS:
        raise StaticAnswersError(f"{path}: {len(out.answers)} answers, more than {MAX_ANSWERS}")
    return out


def _load_yaml(path: Path, raw: str) -> StaticAnswers:
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark else "YAML"
        raise StaticAnswersError(f"{path}: {where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("answers"), list):
        raise StaticAnswersError(f"{path}: top level: expected a mapping with `answers:` (a list) and "
                                 "optionally `similarity_min:`")
    unknown = set(data) - {"answers", "similarity_min"}
    if unknown:
        raise StaticAnswersError(f"{path}: top level: unknown field(s) {sorted(unknown)}")
    out = StaticAnswers(path, _threshold(data.get("similarity_min", DEFAULT_SIMILARITY), path, "similarity_min"))
    for i, item in enumerate(data["answers"]):
        where = f"answers[{i}]"
        if not isinstance(item, dict):
            raise StaticAnswersError(f"{path}: {where}: expected a mapping with `questions:` and `answer:`")
        bad = set(item) - {"questions", "question", "answer"}
        if bad:
            raise StaticAnswersError(f"{path}: {where}: unknown field(s) {sorted(bad)}")
        qs = item.get("questions", item.get("question"))
        if isinstance(qs, str):
            qs = [qs]
        if not isinstance(qs, list) or not qs:
            raise StaticAnswersError(f"{path}: {where}.questions: a non-empty list of questions is required")
        questions = [_text(q, "a question", path, f"{where}.questions[{j}]") for j, q in enumerate(qs)]
        out.add(_text(item.get("answer"), "answer", path, f"{where}.answer"), questions, where)
    return out


def _load_csv(path: Path, raw: str) -> StaticAnswers:
    threshold = DEFAULT_SIMILARITY
    lines = raw.splitlines(keepends=True)
    body: list[tuple[int, str]] = []
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("#"):
            m = re.match(r"\s*#\s*similarity_min\s*[:=]\s*(\S+)", line)
            if m:
                try:
                    value: object = float(m.group(1))
                except ValueError:
                    value = m.group(1)
                threshold = _threshold(value, path, f"line {n}")
            continue
        body.append((n, line))
    out = StaticAnswers(path, threshold)
    reader = csv.reader(io.StringIO("".join(line for _, line in body)))
    try:
        rows = list(reader)
    except csv.Error as exc:
        raise StaticAnswersError(f"{path}: not valid CSV: {exc}") from None
    if not rows or [c.strip().lower() for c in rows[0][:2]] != ["question", "answer"]:
        raise StaticAnswersError(f"{path}: line {body[0][0] if body else 1}: the header must be `question,answer`")
    # csv rows map back to file lines only without multi-line fields; name the data row as well
    pending: tuple[str, list[str], str] | None = None
    for r, row in enumerate(rows[1:], 1):
        where = f"row {r} (line {body[r][0]})" if r < len(body) else f"row {r}"
        if not any(c.strip() for c in row):
            continue
        if len(row) != 2:
            raise StaticAnswersError(f"{path}: {where}: expected 2 columns (question,answer), found {len(row)}")
        q = _text(row[0], "the question", path, where)
        if row[1].strip():
            if pending:
                out.add(pending[0], pending[1], pending[2])
            pending = (_text(row[1], "the answer", path, where), [q], where)
        elif pending is None:
            raise StaticAnswersError(f"{path}: {where}: an empty answer continues the answer above, but there is none")
        else:
            pending[1].append(q)
    if pending:
        out.add(*pending)
    return out
