"""The first import of torch and transformers, one thread at a time (engine/base/imports.py)."""

import subprocess
import sys
import textwrap

# In a fresh interpreter: the main thread holds the import lock as if importing; a config read
# and a model load's import step on other threads must wait for it before importing anything
# themselves (two threads importing transformers at once handed one of them a half-made module).
SCRIPT = textwrap.dedent("""
    import sys, threading
    from engine.base import imports
    from engine.estimates.estimate import config_for
    from engine.estimates.hardware import measure_cpu
    from engine.models.loading import LoadRequest, load_model

    held = imports._lock
    waiting = []
    arrived = threading.Semaphore(0)

    class Watched:  # the lock, saying who came to wait for it
        def __enter__(self):
            waiting.append(threading.current_thread().name)
            arrived.release()
            return held.__enter__()

        def __exit__(self, *exc):
            return held.__exit__(*exc)

    imports._lock = Watched()
    held.acquire()
    results = {}

    def read():
        results["config"] = config_for("HuggingFaceTB/SmolLM2-135M-Instruct")

    def load():
        try:
            load_model(LoadRequest(sys.argv[1], "fp32", "cpu"))
        except Exception as exc:
            results["load"] = exc

    threads = [threading.Thread(target=read, name="read", daemon=True),
               threading.Thread(target=load, name="load", daemon=True)]  # a failed check leaves none behind
    for t in threads:
        t.start()
    for _ in threads:
        assert arrived.acquire(timeout=60), waiting
    assert sorted(waiting) == ["load", "read"], waiting
    # both are waiting, and neither imported anything heavy before it
    assert "transformers" not in sys.modules and "torch" not in sys.modules, "imported before waiting"
    held.release()
    for t in threads:
        t.join(timeout=300)
    assert results["config"].num_hidden_layers == 30
    assert "No such file" in str(results.get("load")), results  # the load went on past its imports
    print("ok")
""")


def test_threads_wait_for_one_import_of_torch_and_transformers(tmp_path):
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "missing")], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
