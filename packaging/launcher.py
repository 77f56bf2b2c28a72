"""Entry point of the PyInstaller bundle: the same ``inference-workbench`` as the pip install."""

import multiprocessing
import sys

if __name__ == "__main__":
    multiprocessing.freeze_support()  # torch and pip-less helpers may spawn processes
    from app.main import main

    sys.exit(main())
