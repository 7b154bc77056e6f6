"""An SFT dataset read and checked record by record before anything trains or is written.

A JSON array or a JSONL file of alpaca, sharegpt or messages records becomes TRL's conversational form. Every
record is checked here, in every format, so that a broken line, a missing field or an unknown role is refused
in one line naming the file, the line the record starts on and the fix, instead of surfacing later inside
`datasets` or the chat template (a `DatasetGenerationError` or a jinja `UndefinedError` many lines up).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.schema import rule_or

__all__ = ["FORMATS", "ROLES", "DataError", "Record", "read_records", "detect_format", "to_conversation",
           "check_file"]

FORMATS = ("auto", "alpaca", "sharegpt", "messages")
# The speaker names of sharegpt ("from") and messages ("role") records, and the chat-template role each becomes.
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "system": "system"}


class DataError(ValueError):
    """A dataset file or record that cannot train; the message is one line: where, what, the fix."""


@dataclass(frozen=True)
class Record:
    line: int  # the line of the file the record starts on (1-based)
    number: int  # its position among the file's records (1-based)
    value: Any


def _where(path: str | Path, rec: Record) -> str:
    return f"{path}:{rec.line}: record {rec.number}"


def _json_lines(path: str | Path, text: str) -> list[Record]:
    out = []
    for i, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not a JSON object ({e.msg} at column {e.colno}); a JSONL file holds one "
                            "complete JSON object per line: fix or delete that line") from None
        out.append(Record(i, len(out) + 1, value))
    return out


def _json_array(path: str | Path, text: str) -> list[Record]:
    # Element by element, so that each record knows the line it starts on.
    dec = json.JSONDecoder()
    out: list[Record] = []
    i = text.index("[") + 1
    n = len(text)

    def skip(j: int) -> int:
        while j < n and text[j] in " \t\r\n":
            j += 1
        return j

    def broken(j: int, what: str) -> DataError:
        line = text.count("\n", 0, j) + 1
        return DataError(f"{path}:{line}: {what} (record {len(out) + 1} of the JSON array); fix the JSON there, "
                         "or write the file as JSONL, one record per line")

    i = skip(i)
    if i < n and text[i] == "]":
        return out
    while True:
        i = skip(i)
        try:
            value, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise broken(e.pos, f"not valid JSON ({e.msg})") from None
        out.append(Record(text.count("\n", 0, i) + 1, len(out) + 1, value))
        i = skip(end)
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] == "]":
            if skip(i + 1) != n:
                raise broken(skip(i + 1), "text after the closing ']'")
            return out
        raise broken(i, "expected ',' or ']' after a record")


def read_records(path: str | Path) -> list[Record]:
    """The records of a JSON array or a JSONL file, each with the line it starts on."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8 JSON or JSONL") \
            from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); give a readable .json or .jsonl file") from None
    stripped = text.lstrip()
    records = _json_array(path, text) if stripped.startswith("[") else _json_lines(path, text)
    if not records:
        raise DataError(f"{path}: no records; give a JSON array or JSONL file of alpaca, sharegpt or messages records")
    return records


def detect_format(record: Any) -> str:
    """The format a record is written in, read off its keys."""
    if isinstance(record, dict):
        if "conversations" in record:
            return "sharegpt"
        if "messages" in record:
            return "messages"
        if "instruction" in record and "output" in record:
            return "alpaca"
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"cannot tell the dataset's format from a record with keys {keys}: alpaca has "
                    "instruction/output, sharegpt conversations, messages messages; set format: in the config")


def _text(record: dict[str, Any], key: str, fmt: str, required: bool) -> str | None:
    value = record.get(key)
    if value is None and not required:
        return None
    if key not in record:
        raise DataError(f"the {fmt} field {key!r} is missing (the record has {sorted(record)}); add it")
    if not isinstance(value, str):
        raise DataError(f"the {fmt} field {key!r} is {type(value).__name__} {_short(value)}; write it as a string")
    return value


def _short(value: Any) -> str:
    s = json.dumps(value, ensure_ascii=False)
    return s if len(s) <= 60 else s[:57] + "..."


def _turns(record: dict[str, Any], fmt: str) -> list[dict[str, str]]:
    key, speaker, body = ("conversations", "from", "value") if fmt == "sharegpt" else ("messages", "role", "content")
    turns = record.get(key)
    if not isinstance(turns, list) or not turns:
        raise DataError(f"the {fmt} field {key!r} must be a non-empty list of turns, got {_short(turns)}")
    messages = []
    for t, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise DataError(f"{key}[{t}] is {_short(turn)}; each turn is an object with {speaker!r} and {body!r}")
        # sharegpt files written with role/content (and messages with from/value) are common: both spellings read
        who = turn.get(speaker, turn.get("role" if speaker == "from" else "from"))
        role = ROLES.get(who) if isinstance(who, str) else None
        if role is None:
            raise DataError(f"{key}[{t}]: {speaker} {_short(who)} is not a known role; use one of {sorted(ROLES)}")
        content = turn.get(body, turn.get("content" if body == "value" else "value"))
        if not isinstance(content, str):
            raise DataError(f"{key}[{t}]: {body} is {_short(content)}; each turn's {body!r} is a string")
        messages.append({"role": role, "content": content})
    return messages


def to_conversation(record: Any, fmt: str, train_on: str = "completion") -> dict[str, list]:
    """One record in TRL's conversational form: {"prompt": [...], "completion": [assistant reply]}, or with
    train_on 'all' {"messages": [...]}. alpaca: instruction / input / output (/ system); sharegpt:
    conversations of {"from", "value"}; messages: {"role", "content"}. Raises DataError naming the fix."""
    if not isinstance(record, dict):
        raise DataError(f"a record is a JSON object, got {type(record).__name__} {_short(record)}")
    if fmt == "alpaca":
        instruction = _text(record, "instruction", fmt, required=True)
        extra = _text(record, "input", fmt, required=False)
        output = _text(record, "output", fmt, required=True)
        system = _text(record, "system", fmt, required=False)
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")},
            {"role": "assistant", "content": output}]
    elif fmt in ("sharegpt", "messages"):
        messages = _turns(record, fmt)
    else:
        raise DataError(f"format={fmt!r}: one of {FORMATS}")
    if messages[-1]["role"] != "assistant":
        raise DataError(f"a {fmt} record must end with the assistant's reply (it ends with a "
                        f"{messages[-1]['role']} turn); add the reply or drop the last turn")
    if train_on == "all":
        return {"messages": messages}
    return {"prompt": messages[:-1], "completion": messages[-1:]}


def check_file(path: str | Path, fmt: str, train_on: str) -> list[tuple[Record, dict[str, list]]]:
    """Every record and its TRL form; the first bad record refused with its line and the fix, and how many
    records are bad in all."""
    records = read_records(path)

    def detected() -> str:  # format "auto": read off the first record's keys
        try:
            return detect_format(records[0].value)
        except DataError as e:
            raise DataError(f"{_where(path, records[0])}: {e}") from None

    fmt = rule_or(fmt, detected)
    out, first, bad = [], None, 0
    for rec in records:
        try:
            out.append((rec, to_conversation(rec.value, fmt, train_on)))
        except DataError as e:
            bad += 1
            first = first or f"{_where(path, rec)}: {e}"
    if first is not None:
        more = f" ({bad} of {len(records)} {fmt} records are refused)" if bad > 1 else ""
        raise DataError(first + more)
    return out
