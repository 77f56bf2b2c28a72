"""The Qt desktop window (PySide6). Imports torch only inside worker threads."""
