#!/usr/bin/env python3
"""Write the values table of helm/agq/README.md from values.yaml comments,
the way helm-docs does (helm-docs itself ships neither on PyPI nor on npm).

A key is documented by a comment block directly above it whose first line
starts with `# --`; its continuation lines are the `#` lines that follow.
The table lists every documented key (nested keys by dotted path) with its
type and default. A value whose key has no `# --` comment is covered by the
closest documented ancestor (e.g. `server.resources.requests.cpu` by
`server.resources`); undocumented() names the values covered by none.

  python3 helm/ci/gen_readme.py          # rewrite the table in README.md
  python3 helm/ci/gen_readme.py --check  # exit 1 when README.md is stale

Only the part between the `<!-- values:begin -->` and `<!-- values:end -->`
markers is generated; the rest of the README is written by hand. Needs
PyYAML.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parent.parent / "agq"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"
README = CHART / "README.md"
BEGIN, END = "<!-- values:begin -->", "<!-- values:end -->"
KEY = re.compile(r"^(\s*)([A-Za-z0-9_.-]+):(?:\s|$)")


def documented(text: str) -> list[tuple[str, str]]:
    """(dotted key, description) for each key with a `# --` comment, in order."""
    out: list[tuple[str, str]] = []
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped)
            continue
        m = KEY.match(line)
        if not m:
            block = []
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        starts = [i for i, c in enumerate(block) if c.startswith("# --")]
        if starts:
            lines = block[starts[-1]:]
            desc = " ".join(c.lstrip("#").strip() for c in lines)[len("--"):].strip()
            out.append((".".join(k for _, k in stack), re.sub(r"\s+", " ", desc)))
        block = []
    return out


def lookup(values: Any, path: str) -> Any:
    for part in path.split("."):
        values = values[part]
    return values


SCHEMA_TYPES = {"boolean": "bool", "integer": "int", "number": "float", "string": "string",
                "array": "list", "object": "object"}


def schema_type(path: str) -> str | None:
    """The type values.schema.json gives a key, without `null` (e.g.
    `int` for ["integer", "null"], `int/string` for several); None when the
    schema does not say."""
    node: Any = json.loads(SCHEMA.read_text())
    for part in path.split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
    types = node.get("type")
    types = [types] if isinstance(types, str) else types or []
    names = [SCHEMA_TYPES[t] for t in types if t in SCHEMA_TYPES]
    return "/".join(names) or None


def type_of(v: Any, path: str = "") -> str:
    if v is None:  # a null default ("empty: decided at render"): the schema's type
        return schema_type(path) or "string"
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list",
            dict: "object"}[type(v)]


def leaves(values: Any, prefix: str = "") -> list[str]:
    if isinstance(values, dict) and values:
        return [p for k, v in values.items() for p in leaves(v, f"{prefix}{k}.")]
    return [prefix[:-1]]


def undocumented() -> list[str]:
    """Values neither documented nor under a documented key."""
    values = yaml.safe_load(VALUES.read_text())
    docs = {k for k, _ in documented(VALUES.read_text())}
    return [leaf for leaf in leaves(values)
            if not any(leaf == d or leaf.startswith(d + ".") for d in docs)]


def cell(text: str) -> str:
    """Escape a table cell: `|` everywhere, `<`/`>` outside code spans
    (Markdown would take `<release>` for an HTML tag)."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def table() -> str:
    text = VALUES.read_text()
    values = yaml.safe_load(text)
    rows = ["| Key | Type | Default | Description |", "|-----|------|---------|-------------|"]
    for key, desc in documented(text):
        v = lookup(values, key)
        default = json.dumps(v, separators=(",", ":")) if v != "" else '""'
        default = default.replace("|", "\\|")
        rows.append(f"| {key} | {type_of(v, key)} | `{default}` | {cell(desc)} |")
    return "\n".join(rows)


def render(readme: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    current = README.read_text()
    fresh = render(current)
    if "--check" in sys.argv[1:]:
        missing = undocumented()
        if missing:
            print(f"undocumented values: {', '.join(missing)}", file=sys.stderr)
        if fresh != current:
            print("helm/agq/README.md is stale: run python3 helm/ci/gen_readme.py",
                  file=sys.stderr)
        return 1 if missing or fresh != current else 0
    README.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
