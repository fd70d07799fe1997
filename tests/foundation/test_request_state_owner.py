"""A request's offload state has one owner (docs/architecture.md, The connector contract):
only ``RequestTransfer``'s own methods write its fields. Any other product module that
assigns to one of them (``transfer.phase = ...``, ``transfer.figures.plan = ...``,
``x.token_origins += ...``) fails here, named by file and line."""

from __future__ import annotations

import ast
import dataclasses
import os
from pathlib import Path

from connector.request_transfer import RequestTransfer

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "connector" / "request_transfer.py"
FIELDS = {field.name for field in dataclasses.fields(RequestTransfer)}


def product_files() -> list[Path]:
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [
            name for name in subfolders if name != "tests" and not name.startswith((".", "build"))
        ]
        files += [Path(folder) / name for name in names if name.endswith(".py")]
    return sorted(files)


def writes_to_transfer_fields(source: str) -> list[tuple[int, str]]:
    """(line, target) of each assignment whose target goes through a RequestTransfer
    field of an object other than ``self`` (``a.phase = ``, ``a.figures.plan = ``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            chain, part = [], target
            while isinstance(part, (ast.Attribute, ast.Subscript)):
                if isinstance(part, ast.Attribute):
                    chain.append(part.attr)
                part = part.value
            root = part.id if isinstance(part, ast.Name) else None
            if chain and root not in (None, "self", "cls") and FIELDS & set(chain[1:] or chain):
                found.append((node.lineno, ast.unparse(target)))
    return found


def test_the_detector_sees_a_write_through_a_field():
    assert writes_to_transfer_fields("transfer.phase = 1\nt.figures.plan = 'x'\nt.token_origins += []\n") == [
        (1, "transfer.phase"),
        (2, "t.figures.plan"),
        (3, "t.token_origins"),
    ]
    assert writes_to_transfer_fields("self.phase = 1\nrequest.num_computed_tokens = 3\n") == []


def test_only_request_transfer_writes_its_fields():
    assert OWNER in product_files()
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for path in product_files()
        if path != OWNER
        for line, target in writes_to_transfer_fields(path.read_text())
    ]
    assert offenders == [], "writes to a request's offload state outside its owner:\n" + "\n".join(offenders)
