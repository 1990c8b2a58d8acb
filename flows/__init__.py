"""The orchestration layer: the Prefect flow and its tasks, the ``capflow`` CLI, the local server stack.

Prefect reads its settings once, when it is first imported, and only this package imports it: the defaults are set
here, before any module of the package can import Prefect (an explicit setting in the environment wins). Prefect's
temporary server gets 90 s to start instead of 20 s, which a loaded machine overran (2 of 16 starts on a busy 2-core
box), and sends no telemetry (offline, the attempt logged an ERROR in every run).
"""

import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
