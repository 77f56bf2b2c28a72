import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import engine
for module in pkgutil.walk_packages(engine.__path__, "engine."):
    importlib.import_module(module.name)
qt = sorted(m for m in sys.modules if m.split('.')[0] in ('PySide6', 'PyQt5', 'PyQt6', 'shiboken6', 'pyqtgraph'))
print(','.join(qt))
"""


def test_importing_the_engine_loads_no_qt():
    result = subprocess.run([sys.executable, "-c", CHECK],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_a_generation_loads_no_qt(tiny_llama):
    code = (
        "import sys\n"
        "from engine.loading import LoadRequest, load_model\n"
        "from engine.request import GenerationRequest\n"
        f"m = load_model(LoadRequest({str(tiny_llama)!r}, 'fp32', 'cpu'))\n"
        "list(m.generate(GenerationRequest('fox', mode='raw', max_new_tokens=2)))\n"
        "print(','.join(sorted(n for n in sys.modules if n.split('.')[0] in ('PySide6', 'shiboken6', 'pyqtgraph'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1:] in ([], [""])
