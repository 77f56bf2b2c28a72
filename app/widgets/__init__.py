"""Widgets the windows share: plots, lanes, the output view, prompt box and panels."""
