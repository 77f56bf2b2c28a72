import json
import subprocess
import sys

import pytest

from engine.cli import main
from engine.generation.generate import generate

BENCH_KEYS = {
    "model", "precision", "device", "prompt_tokens", "tokens", "tokens_counted_by", "token_ids", "text",
    "finish_reason", "ttft_s",
    "decode_tokens_per_s", "per_token_latency_s", "kv_cache_bytes", "kv_cache_bytes_predicted",
    "kv_cache_bytes_series", "kv_cache_bytes_predicted_series", "weights_bytes", "peak_memory_bytes",
    "versions", "finished", "loaded",
}


def cli(*args, stdin=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout)


def test_bench_writes_the_documented_json(tmp_path, tiny_llama, loaded_llama):
    out = tmp_path / "out.json"
    result = cli("bench", "--model", str(tiny_llama), "--precision", "fp32", "--device", "cpu", "--raw",
                 "--prompt", "The quick brown fox", "--max-new-tokens", "12", "--ignore-eos", "--greedy",
                 "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert BENCH_KEYS <= report.keys()
    n = len(report["token_ids"])
    assert n == 12 and report["finish_reason"] == "length"
    assert (report["tokens"], report["tokens_counted_by"]) == (12, "token ids")
    for series in ("per_token_latency_s", "kv_cache_bytes_series", "kv_cache_bytes_predicted_series"):
        assert len(report[series]) == n
    assert report["kv_cache_bytes_series"] == report["kv_cache_bytes_predicted_series"]
    assert report["kv_cache_bytes"] == report["kv_cache_bytes_series"][-1]
    assert report["text"] == loaded_llama.tokenizer.decode(report["token_ids"])
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    assert set(report["finished"]) >= {"reason", "tokens", "ttft_s", "decode_tokens_per_s", "peak_memory_bytes"}
    assert report["precision"] == "fp32" and report["device"] == "cpu"
    # the same greedy tokens as the engine in this process
    from engine.base.request import GenerationRequest

    again = list(generate(loaded_llama, GenerationRequest("The quick brown fox", mode="raw", max_new_tokens=12,
                                                         ignore_eos=True)))[-1]
    assert list(again.token_ids) == report["token_ids"]
    # the human summary
    assert "decode" in result.stdout and "KV cache" in result.stdout and "tok/s" in result.stdout


def test_prompt_from_stdin_and_file(tmp_path, tiny_llama):
    base = ["bench", "--model", str(tiny_llama), "--raw", "--max-new-tokens", "3", "--quiet", "--json"]
    piped = cli(*base, str(tmp_path / "a.json"), "--prompt", "-", stdin="fox jumps")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("fox jumps", encoding="utf-8")
    from_file = cli(*base, str(tmp_path / "b.json"), "--prompt-file", str(prompt_file))
    assert piped.returncode == 0 and from_file.returncode == 0, piped.stderr + from_file.stderr
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["prompt_tokens"] == b["prompt_tokens"] > 0 and a["token_ids"] == b["token_ids"]


@pytest.mark.parametrize("args,needle", [
    (["bench", "--model", "/no/such/folder", "--prompt", "hi"], "No such file or folder"),
    (["bench", "--prompt", "hi", "--temperature", "abc"], "invalid float value"),
    (["bench", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["bench", "--prompt", "hi", "--precision", "int3"], "invalid choice"),
    (["bench", "--prompt", "hi", "--device", "cuda:7"], "cuda"),
    (["bench", "--prompt", "   "], "empty"),
    (["bench", "--tokens", "3"], "unrecognized arguments: --tokens 3 (see inference-workbench bench --help)"),
    (["bench", "--model", "nobody-x9/no-such-model", "--offline", "--prompt", "hi"], "nobody-x9/no-such-model"),
])
def test_errors_are_one_line_with_nonzero_exit(args, needle):
    result = cli(*args)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error:") and needle.lower() in lines[-1].lower(), result.stderr
    assert "Traceback" not in result.stderr


def test_over_long_prompt(tmp_path, byte_tokenizer):
    from tests.tiny import build_model_folder

    folder = build_model_folder(tmp_path / "short", "llama", byte_tokenizer, max_position_embeddings=16)
    result = cli("bench", "--model", str(folder), "--raw", "--prompt", "fox " * 40)
    assert result.returncode == 1 and "context window" in result.stderr and "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = cli("--debug", "bench", "--model", "/no/such/folder", "--prompt", "hi")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_models_lists_the_default_and_the_hub_cache(capsys, isolated_cache, tmp_path, tiny_llama, monkeypatch):
    import huggingface_hub.constants as hub_constants

    from tests.engine.test_sources import make_hub_cache

    make_hub_cache(tmp_path / "hub", "tiny/llama", tiny_llama)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("default") and "not downloaded yet" in lines[0]
    assert lines[1].startswith("tiny/llama") and "ready" in lines[1] and "snapshots" in lines[1]


def test_the_app_hands_every_cli_subcommand_to_the_cli():
    from app.main import CLI_COMMANDS
    from engine.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    assert set(CLI_COMMANDS) == set(subcommands)


def test_help_lists_every_command_and_each_command_has_an_example_that_parses(capsys):
    """--help names every subcommand with a line on it (the window's --help too); each
    subcommand's help ends with an example of itself, which its own parser takes."""
    import shlex

    from app.main import CLI_COMMANDS
    from app.main import build_parser as window_parser
    from engine.cli import build_parser

    parser = build_parser()
    listing, window = parser.format_help(), window_parser().format_help()
    for name in CLI_COMMANDS:
        assert f"\n  {name} " in listing and f"\n  {name} " in window
        text = parser.commands[name].format_help()
        example = text.rsplit("example:\n", 1)[1].strip()
        argv = shlex.split(example)
        assert argv[:2] == ["inference-workbench", name]
        assert parser.parse_args(argv[1:]).command == name
