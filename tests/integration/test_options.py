"""Plugin options: declared once per plugin, checked by create_backend, listed by `kvbridge plugins NAME`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvbridge
from kvbridge.base import options
from kvbridge.base.errors import ConfigError
from kvbridge.plugin.registry import plugin_options, registry


def test_a_misspelt_setting_names_the_valid_one() -> None:
    with pytest.raises(ConfigError) as err:
        kvbridge.create_backend("mooncake", protocl="tcp")
    text = str(err.value)
    assert "'protocl'" in text and "did you mean 'protocol'?" in text
    assert "retry_backoff" in text  # every valid name is listed


def test_an_unused_option_is_refused_and_the_used_ones_are_declared() -> None:
    with pytest.raises(ConfigError, match="no option 'connections'"):
        kvbridge.create_backend("tcp", connections=4)
    [(_, declared)] = plugin_options("tcp")
    assert {o.name: o.default for o in declared} == {
        "workers": 4,
        "port": 0,
        "connect_timeout": 10.0,
        "handshake_timeout": 10.0,
        "max_handshakes": 64,
        "transfer_deadline": 30.0,
        "secret": None,
        "secret_file": None,
        "insecure": False,
    }


def test_values_are_converted_to_the_declared_type_or_refused() -> None:
    backend = kvbridge.create_backend("tcp", connect_timeout="2.5", workers="2")
    try:
        assert backend.config.options["workers"] == 2 and backend.config.options["connect_timeout"] == 2.5
    finally:
        backend.close()
    with pytest.raises(ConfigError, match=r"option port of backend 'tcp' \(given a str\) must be int"):
        kvbridge.create_backend("tcp", port="http")
    with pytest.raises(ConfigError, match="must be int"):
        kvbridge.create_backend("tcp", port=1.5)
    with pytest.raises(ConfigError, match="must be int"):
        kvbridge.create_backend("tcp", workers=True)


def test_optional_and_bool_options() -> None:
    @attrs.frozen
    class Opts(kvbridge.BackendOptions):
        limit: int | None = kvbridge.option(None, "a limit")
        fast: bool = kvbridge.option(False, "go fast")

    assert options.parse(Opts, {"limit": "7", "fast": "yes"}, what="t") == Opts(limit=7, fast=True)
    assert options.parse(Opts, {"limit": None}, what="t").limit is None
    with pytest.raises(ConfigError, match=re.escape("must be int | None")):
        options.parse(Opts, {"limit": "many"}, what="t")
    with pytest.raises(ConfigError, match="must be a bool"):
        options.parse(Opts, {"fast": "maybe"}, what="t")
    assert [o.name for o in options.describe(Opts)] == ["workers", "limit", "fast"]


@pytest.mark.parametrize(
    ("name", "given", "expected"),
    [
        ("loopback", {"max_batch": -3}, "option max_batch must be from 1 to 16777216"),  # made every transfer hang
        ("tcp", {"workers": "0"}, "option workers must be from 1 to 1024"),  # failed at the first transfer
        ("tcp", {"port": 99999}, "option port must be from 0 to 65535"),
        ("mooncake", {"protocol": "tcp", "retries": -1}, "option retries must be from 0 to 100"),
        # declared from 0 and refused later by the backend (0 would spin its progress loop): the bound is the schema's
        ("nixl", {"progress_interval": 0}, "option progress_interval must be from 0.0001 to 86400"),
    ],
)
def test_a_number_outside_its_declared_bounds_is_refused_before_the_plugin_is_built(
    name: str, given: dict, expected: str
) -> None:
    with pytest.raises(ConfigError, match=f"backend '{name}': {expected}"):
        kvbridge.create_backend(name, **given)


def test_bounds_apply_to_a_plugin_s_own_options_class_and_are_listed_with_its_docs() -> None:
    @attrs.frozen
    class Opts(kvbridge.BackendOptions):
        limit: int | None = kvbridge.option(None, "a limit", min=1)
        share: float = kvbridge.option(0.5, "a share", min=0, max=1)

    assert options.parse(Opts, {"limit": None, "share": "1"}, what="t") == Opts(limit=None, share=1.0)
    with pytest.raises(ConfigError, match="t: option share must be from 0 to 1, got 1.5"):
        options.parse(Opts, {"share": 1.5}, what="t")
    with pytest.raises(ConfigError, match="option limit must be at least 1"):
        Opts(limit=0)  # built directly, without parse
    docs = {o.name: o.doc for o in options.describe(Opts)}
    assert docs["share"] == "a share (from 0 to 1)" and docs["workers"].endswith("(from 1 to 1024)")


def test_loopback_max_batch_reaches_its_capabilities() -> None:
    backend = kvbridge.create_backend("loopback", max_batch="4")
    try:
        assert backend.capabilities.max_batch == 4
    finally:
        backend.close()


def test_every_registered_plugin_declares_documented_options() -> None:
    reg = registry()
    assert {"tcp", "loopback", "mooncake"} <= set(reg.backends)
    assert {"cpu", "cuda", "npu", "mlu", "example"} <= set(reg.devices)
    for entry in reg.backends.values():
        assert issubclass(entry.options, kvbridge.BackendOptions), entry.name
    for entry in [*reg.backends.values(), *reg.devices.values()]:
        for info in entry.option_infos():
            assert info.doc and info.type, f"{entry.kind} {entry.name} option {info.name} is undocumented"


def test_plugins_name_prints_options_with_defaults_and_docs() -> None:
    run = [sys.executable, "-m", "kvbridge", "plugins", "mooncake"]
    table = subprocess.run(run, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "max_descriptor_bytes" in table and "1024" in table and "doubling after each" in table
    rows = json.loads(subprocess.run([*run, "--json"], capture_output=True, text=True, check=True, timeout=120).stdout)
    [mooncake] = rows
    assert mooncake["kind"] == "backend" and mooncake["distribution"] == "kvbridge-mooncake"
    declared = {o["name"]: (o["default"], o["doc"]) for o in mooncake["options"]}
    assert declared["retries"][0] == 1 and declared["retry_backoff"][0] == 0.05
    assert all(doc for _, doc in declared.values())


def test_the_options_class_in_the_plugin_docs_works_as_documented() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    [block] = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "class MyOptions" in b]
    scope: dict[str, object] = {}
    exec(compile(block, "docs/plugins.md", "exec"), scope)  # noqa: S102 - our own docs, to keep them true
    my_options = scope["MyOptions"]
    assert {o.name: o.default for o in options.describe(my_options)} == {
        "workers": 4,
        "queue_depth": 64,
        "compress": False,
    }
    with pytest.raises(ConfigError, match="did you mean 'queue_depth'"):
        options.parse(my_options, {"queue_depht": 8}, what="backend 'mytransport'")
    assert options.parse(my_options, {"queue_depth": "8"}, what="t").queue_depth == 8


def _numeric_options() -> list[tuple[str, type, str]]:
    """(plugin, options class, option name) of every int or float option a registered plugin declares."""
    found = []
    for table in (registry().backends, registry().devices):
        for name, entry in sorted(table.items()):
            hints = options._hints(entry.options)
            for f in attrs.fields(entry.options):
                if re.search(r"\b(int|float)\b", str(hints.get(f.name))):
                    found.append((name, entry.options, f.name))
    return found


NON_FINITE = st.sampled_from([float("nan"), float("inf"), float("-inf"), "nan", "NaN", "inf", "Infinity", "-inf"])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(option=st.sampled_from(_numeric_options()), value=NON_FINITE)
def test_every_numeric_option_refuses_nan_and_infinity(option: tuple[str, type, str], value: object) -> None:
    """NaN passes every bound (it compares false), and infinity overflows the timers the options feed."""
    plugin, schema, name = option
    with pytest.raises(ConfigError, match=name):
        options.parse(schema, {name: value}, what=plugin)


@pytest.mark.parametrize("option", _numeric_options(), ids=lambda o: f"{o[0]}.{o[2]}" if isinstance(o, tuple) else "")
def test_every_numeric_option_has_an_upper_bound(option: tuple[str, type, str]) -> None:
    _plugin, schema, name = option
    assert attrs.fields_dict(schema)[name].metadata.get("kvbridge_max") is not None, f"{name} has no upper bound"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    key=st.sampled_from(["lease_s", "pull_timeout_s", "idle_wait_ms", "stream_idle_wait_ms"]),
    value=NON_FINITE | st.floats(min_value=1e7, allow_nan=False) | st.floats(max_value=-1e-9, allow_nan=False),
)
def test_connector_settings_refuse_non_finite_and_out_of_range_numbers(key: str, value: object) -> None:
    """Connector settings refuse non-finite and out-of-range numbers, which broke the side channel.

    `lease_s: Infinity` killed the side channel's thread (OverflowError), `lease_s: NaN` never expired and
    `pull_timeout_s: NaN` waited for ever.
    """
    from kvbridge.adapters.vllm.settings import Settings

    with pytest.raises(ConfigError, match=key):
        Settings.from_extra_config({key: value})


@settings(max_examples=100, deadline=None, derandomize=True)
@given(
    lease_s=st.floats(min_value=0.001, max_value=86_400),
    pull_timeout_s=st.floats(min_value=0.001, max_value=86_400),
    idle_wait_ms=st.floats(min_value=0, max_value=60_000),
)
def test_connector_settings_take_finite_numbers_in_range(
    lease_s: float, pull_timeout_s: float, idle_wait_ms: float
) -> None:
    from kvbridge.adapters.vllm.settings import Settings

    s = Settings.from_extra_config({"lease_s": lease_s, "pull_timeout_s": pull_timeout_s, "idle_wait_ms": idle_wait_ms})
    assert (s.lease_s, s.pull_timeout_s, s.idle_wait_ms) == (lease_s, pull_timeout_s, idle_wait_ms)


@pytest.mark.parametrize("lease_s", [float("inf"), float("nan"), 0.0, 1e9])
def test_a_ledger_refuses_a_lease_that_never_ends(lease_s: float) -> None:
    from kvbridge.control import Ledger

    with pytest.raises(ConfigError, match="lease timeout"):
        Ledger(lambda lease, why: None, timeout_s=lease_s)
    with pytest.raises(ConfigError, match="lease timeout"):
        Ledger(lambda lease, why: None).offer("r", [1], 1, timeout_s=lease_s)
