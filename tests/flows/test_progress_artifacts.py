"""Within a Prefect run, the stages' progress reaches the UI as progress artifacts of their task runs (not as log
lines): a real flow run on Prefect's temporary server, a task whose work reports through captioning.progress."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_a_task_runs_progress_is_a_progress_artifact(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPFLOW_PROGRESS_EVERY", "0")
    monkeypatch.delenv("CAPFLOW_QUIET", raising=False)
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    from captioning import progress
    from flows.pipeline import ProgressArtifacts

    @task
    def work() -> int:
        done = 0
        for _ in progress.bar(range(8), desc="extracting", unit="img"):
            done += 1
        for epoch in (1, 2):  # one artifact per kind of bar, updated: not one per epoch
            for _ in progress.bar(range(4), desc=f"epoch {epoch}/2", unit="batch"):
                done += 1
        return done

    @flow
    def run() -> str:
        from prefect.runtime import flow_run

        work()
        return str(flow_run.get_id())

    sink = ProgressArtifacts()
    progress.add_sink(sink)
    try:
        run_id = run()
    finally:
        progress.remove_sink(sink)
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]), type=ArtifactFilterType(any_=["progress"])))
    assert sorted(a.description for a in arts) == ["capflow: epoch N/N", "capflow: extracting"]
    assert all(float(a.data) == 100.0 for a in arts)
    assert arts[0].task_run_id is not None  # the task run's, where the UI shows it
