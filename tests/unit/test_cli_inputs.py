"""What a `kvbridge` command is given is refused, before anything starts, when it cannot mean what it says.

Each case below was once taken: NaN slipped past `< 0` checks, 0 was read as "the default", and the bench or the
chaos run then started vLLM servers with it (a NaN request rate, no output tokens, a 0 s timeout); an option of another
bench mode or of a fault not asked for was read by nothing."""

from __future__ import annotations

import argparse
import math
import re

import pytest

from kvbridge.cli import main
from kvbridge.cli.numbers import real, seconds, whole


def test_whole_numbers_and_reals_keep_their_bounds_and_refuse_what_is_no_number() -> None:
    assert whole()("1") == 1 and whole(0, 19)("19") == 19
    for text in ("0", "1.5", "x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            whole()(text)
    assert seconds("0.25") == 0.25 and real(zero=True)("0") == 0.0 and real("a share", 0, 1, zero=True)("1") == 1.0
    for text in ("0", "-1", "nan", "inf", "-inf", "86401", "1e400", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected seconds"):
            seconds(text)
    assert math.isfinite(real(high=1e9)("1e9"))


BAD = [
    ["bench", "--tokens", "0"],
    ["bench", "--requests", "0"],
    ["bench", "--repeat", "0"],
    ["bench", "--timeout", "nan"],
    ["bench", "--timeout", "0"],
    ["bench", "--engine", "vllm", "--lengths", "0"],
    ["bench", "--engine", "vllm", "--load", "--rates", "nan"],
    ["bench", "--engine", "vllm", "--load", "--rates", "inf"],
    ["bench", "--engine", "vllm", "--load", "--concurrency", "0"],
    ["bench", "--engine", "vllm", "--load", "--output-len", "0"],
    ["bench", "--engine", "vllm", "--load", "--slo-factor", "nan"],
    ["bench", "--engine", "vllm", "--load", "--slo", "inf,8"],
    ["bench", "--engine", "vllm", "--load", "--idle-s", "-1"],
    ["bench", "--engine", "vllm", "--load", "--slices", "0"],
    ["bench", "--engine", "vllm", "--idle", "--gaps", "nan"],
    ["bench", "--engine", "vllm", "--live-moves", "--hosts", "--precopy-tail", "-1"],
    ["bench", "--engine", "vllm", "--live-moves", "--hosts", "--engine-nice", "20"],
    ["bench", "--scale", "--spread", "0"],
    ["bench", "--scale", "--records", "-1"],
    ["bench", "--engine", "vllm-connector", "--decode-block-size", "0"],
    ["chaos", "--requests", "0"],
    ["chaos", "--max-tokens", "0"],
    ["chaos", "--lease-s", "nan"],
    ["chaos", "--hang-timeout", "-1"],
    ["chaos", "--transfer-error-rate", "2"],
    ["chaos", "--slow-rate", "nan"],
    ["chaos", "--gap-range", "nan", "5"],
    ["chaos", "--net-fault-s", "inf"],
    ["plan", "--prefill", "tp1", "--decode", "tp1", "--model", "tiny-gqa", "--tokens", "0"],
    ["trace", "http://127.0.0.1:9", "--max-tokens", "0"],
    ["drain", "x", "--registry", "redis://127.0.0.1:9", "--ttl", "nan"],
    ["proxy", "--max-connections", "0"],
    ["proxy", "--header-timeout", "inf"],
]


@pytest.mark.parametrize("argv", BAD, ids=lambda argv: " ".join(argv))
def test_a_number_out_of_its_bounds_is_refused_by_name(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    option = next(a for a in reversed(argv) if a.startswith("--"))
    assert f"argument {option}: " in capsys.readouterr().err


@pytest.mark.parametrize("url", ["notaurl", "127.0.0.1:8000", "http://", "http://h:port"])
def test_trace_refuses_a_proxy_url_it_cannot_reach_saying_how_to_write_one(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["trace", url])
    assert exit_.value.code == 2
    assert "argument URL: " in (err := capsys.readouterr().err) and "write it as http://HOST:PORT" in err
    with pytest.raises(SystemExit):
        main(["trace", "http://127.0.0.1:8000/v1"])  # it adds /v1/completions itself
    assert "write it as http://127.0.0.1:8000, without /v1" in capsys.readouterr().err


def test_chaos_refuses_a_pause_range_upside_down_and_outputs_longer_than_the_servers_hold(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["chaos", "--faults", "idle-gap", "--gap-range", "9", "1"]) == 2
    assert "--gap-range MIN MAX: MIN 9 is above MAX 1" in capsys.readouterr().err
    # every prompt would have been cut to one token, and vLLM would have refused each request as too long
    assert main(["chaos", "--max-tokens", "1023"]) == 2
    assert "--max-tokens 1023 leaves no room for a prompt within --max-model-len 1024" in capsys.readouterr().err


def test_a_bench_option_its_mode_does_not_read_is_refused_and_one_it_reads_is_taken() -> None:
    """`kvbridge bench --rates 2` ran the pair bench and ignored --rates, as every mode did with the others' options."""
    from kvbridge.base.errors import ConfigError
    from kvbridge.cli import build_parser
    from kvbridge_tools.cli.bench import check_read, pick_mode

    def checked(*argv: str) -> str:
        args = build_parser().parse_args(["bench", *argv])
        mode = pick_mode(args)
        check_read(args, mode)
        return mode

    taken = [
        (
            ["--engine", "vllm", "--load", "--rates", "2", "--concurrency", "--slices", "4", "--noise", "cpu=1"],
            "vllm-load",
        ),
        (["--engine", "vllm", "--live-moves", "--hosts", "--precopy-tail", "4", "--moves", "precopy"], "vllm-moves"),
        (["--engine", "vllm", "--idle", "--gaps", "5", "--idle-systems", "nixl"], "vllm-idle"),
        (["--scale", "--sizes", "2x2", "--spread", "2", "--records", "0"], "scale"),
        (["--engine", "vllm", "--lengths", "64", "--model-dir", "/m", "--executor", "mp"], "vllm"),
        (
            ["--engine", "vllm", "--load", "--model-dir", "/m", "--keep-logs", "/l", "--nixl-busy-poll", "off"],
            "vllm-load",
        ),
    ]
    for argv, mode in taken:
        assert checked(*argv) == mode
    for argv, why in [
        (["--rates", "2"], "--rates is read by `kvbridge bench --engine vllm --load` alone"),
        (["--engine", "vllm", "--precopy-tail", "4"], "--precopy-tail is read by `kvbridge bench --engine vllm --live"),
        (["--engine", "vllm", "--load", "--gaps", "5"], "--gaps is read by `kvbridge bench --engine vllm --idle`"),
        (
            ["--sizes", "2x2"],
            "--sizes is read by `kvbridge bench --scale` alone, not by the pair bench: add --scale, or drop --sizes",
        ),
        (["--engine", "vllm", "--live-moves", "--hosts", "--concurrency"], "--concurrency is read by"),
        (["--model-dir", "/m"], "--model-dir is read by `kvbridge bench --engine vllm` alone, not by the pair bench"),
        (
            ["--engine", "vllm", "--load", "--lengths", "64"],
            "--lengths is read by `kvbridge bench --engine vllm without",
        ),
    ]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            checked(*argv)


def test_a_chaos_option_of_a_fault_not_asked_for_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, fault in [
        (["--transfer-error-rate", "0.5"], "transfer-error"),
        (["--slow-s", "3"], "slow-peer"),
        (["--gap-range", "1", "2"], "idle-gap"),
        (["--hosts", "--faults", "loss", "--net-fault-s", "1"], "partition or flap or bandwidth-drop"),
    ]:
        assert main(["chaos", *argv]) == 2
        assert f"is read with the {fault} fault: add it to --faults" in capsys.readouterr().err


def test_drain_without_a_registry_of_servers_says_which_to_name(capsys: pytest.CaptureFixture[str]) -> None:
    """`--registry p2p` (the transports' "no registry") was told to name the server it had named."""
    assert main(["drain", "decode-1", "--registry", "p2p"]) == 2
    assert (
        "--registry p2p: name the servers' registry, redis://HOST:PORT or etcd://HOST:PORT" in capsys.readouterr().err
    )
    assert main(["drain", "--registry", "redis://127.0.0.1:9"]) == 2
    assert "say which server to drain (--list shows the servers in redis://127.0.0.1:9)" in capsys.readouterr().err
