"""The main job (client/python/examples/train_tiny_llama.py, run by scripts/demo) at a few
steps: it starts its own server, trains the local-head and remote-head variants in their own
processes, their per-step losses agree (fp32, relative 1e-4), the table prints, and the server
drains and exits 0. No memory or speed assertion here: those are what the full run shows."""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "client" / "python" / "examples"))

import train_tiny_llama  # noqa: E402


def test_main_job_runs_both_heads_and_they_agree(capsys):
    binary = os.environ.get("REMOTEHEAD_SERVER_BINARY",
                            str(ROOT / "build" / "server" / "remotehead-server"))
    args = train_tiny_llama.parse_args([f"--server-binary={binary}", "--steps=4", "--batch=2",
                                        "--seq=32", "--vocab=4096", "--hidden=32"])
    results = train_tiny_llama.compare(args)
    assert results["server_exit_code"] == 0
    assert len(results["local"]["losses"]) == len(results["remote"]["losses"]) == 4
    assert results["loss_deviation"] <= 1e-4
    train_tiny_llama.print_table(results)
    table = capsys.readouterr().out
    assert "trainer peak memory (MiB)" in table and "tokens/s" in table
