"""Every multi-process trainer script ends its process group before the interpreter exits.

A gloo process group left to the interpreter's exit can abort a rank after a complete run
("terminate called without an active exception", SIGABRT: torch's Gloo worker threads still
hold the last collective's tensors while Python finalises, pytorch/pytorch#190489) — it did,
in CI, after a complete GRPO run. The abort is a race at exit, so no test reproduces it
reliably; this reads the scripts instead.

A trainer script is a Python file with a `__main__` block (the test workers, the examples, the
Kubernetes trainer) that starts a process group itself (`init_process_group`) or has
transformers / TRL start one (`ddp_backend`, what every multi-process Trainer job here sets).
Each must call tests/python/ddp_trainer_job.py's `end_process_group()` or
`destroy_process_group()` (after a barrier). The scripts known to be trainer scripts must be
found as such, and the rule is also run on a small tree that breaks it, so that a rule that
could never fail fails this test. docs/data-parallel.md's example shows the teardown.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHERE = ("tests/python", "tests/bench", "client/python/examples", "deploy")
STARTS_A_GROUP = re.compile(r"\binit_process_group\(|\bddp_backend\b")
ENDS_IT = re.compile(r"\bend_process_group\(\)|\bdestroy_process_group\(\)")
KNOWN = {"tests/python/ddp_trainer_job.py", "tests/python/trl_grpo_job.py",
         "tests/python/trl_distillation_job.py", "tests/python/fsdp2_job.py",
         "client/python/examples/ddp_train.py", "client/python/examples/train_tiny_llama.py",
         "deploy/k8s/trainer/train.py"}


def trainer_scripts(root: Path):
    """{path relative to root: whether it ends its process group} for every trainer script."""
    found = {}
    for where in WHERE:
        for path in sorted((root / where).rglob("*.py")):
            text = path.read_text()
            if "__main__" in text and STARTS_A_GROUP.search(text):
                found[path.relative_to(root).as_posix()] = bool(ENDS_IT.search(text))
    return found


def test_every_trainer_script_ends_its_process_group():
    found = trainer_scripts(ROOT)
    assert KNOWN <= found.keys(), sorted(KNOWN - found.keys())
    assert [path for path, ends in found.items() if not ends] == []


def test_a_script_that_does_not_end_its_group_is_caught(tmp_path):
    jobs = tmp_path / "tests" / "python"
    jobs.mkdir(parents=True)
    (jobs / "good_job.py").write_text(
        "import torch.distributed as dist\n\ndef main():\n    dist.init_process_group('gloo')\n"
        "\nif __name__ == '__main__':\n    main()\n    end_process_group()\n")
    (jobs / "bad_job.py").write_text(
        "args = TrainingArguments(ddp_backend='gloo')\n\nif __name__ == '__main__':\n"
        "    main()\n")
    (jobs / "helper.py").write_text("def f():\n    init_process_group('gloo')\n")  # no __main__
    assert trainer_scripts(tmp_path) == {"tests/python/good_job.py": True,
                                         "tests/python/bad_job.py": False}


def test_the_data_parallel_example_ends_its_process_group():
    text = (ROOT / "docs" / "data-parallel.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]  # the first Python block
    assert "barrier()" in example and example.rstrip().endswith("destroy_process_group()")
    assert "## Ending the processes" in text  # the why
