"""The commands that read a workspace: clean, report, publish, compare."""
