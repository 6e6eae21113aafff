"""The pipeline stages: each ``run(config, workspace)`` reads its inputs from the workspace and
hands their paths to the library packages beneath (``data``, ``model``, ``batching``,
``train``, ``eval``), which never read one."""
