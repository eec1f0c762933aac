"""Every hook is documented and exercised, so the docs cannot drift from the specs."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from kvbridge.plugin import hookspecs

REPO = Path(__file__).resolve().parents[2]
HOOKS = [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("kvbridge_")]


def test_there_are_hooks_and_each_belongs_to_the_plugin_api() -> None:
    assert HOOKS == ["kvbridge_backends", "kvbridge_commands", "kvbridge_devices"]
    assert sorted(hookspecs.HOOKS) == HOOKS


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_contract_docstring_and_a_doc_entry(hook: str) -> None:
    # the spec hooks say which spec they return; kvbridge_commands what a command module has
    contract = "add_parser(" if hook == "kvbridge_commands" else "Spec("
    assert contract in (getattr(hookspecs, hook).__doc__ or "")
    docs = "\n".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    assert hook in docs, f"{hook} is not documented in docs/"


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_implemented_by_a_plugin_under_test(hook: str) -> None:
    sources = [p.read_text() for p in (REPO / "tests").rglob("*.py") if p.name != Path(__file__).name]
    sources += [p.read_text() for p in (REPO / "plugins").rglob("*.py")]
    assert any(f"def {hook}(" in s for s in sources), f"no plugin in tests/ or plugins/ implements {hook}"
