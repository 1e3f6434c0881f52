"""Renderers of plain lint/trace data. Only ``text`` imports rich."""
