"""Typed results of the stages: what a job returns, what the next stage receives and what the stage cache keeps.

Each is a frozen dataclass of small JSON values (paths, URIs, digests, MLflow run ids, metrics), never tensors.
``to_record`` / ``from_record`` round-trip through a stage record; a record whose fields do not match the type
(written by another capflow version, edited by hand) raises :class:`RecordMismatch`, which the stage cache reads
as "not cached" - the stage runs again instead of failing later with a KeyError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R", bound="Ref")


class RecordMismatch(ValueError):
    """A stage record does not hold the fields of the expected result type."""


@dataclass(frozen=True)
class Ref:
    def to_record(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_record(cls: type[R], record: dict[str, Any]) -> R:
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing, extra = required - set(record), set(record) - names
        if missing or extra:
            raise RecordMismatch(f"not a {cls.__name__} record: missing {sorted(missing)}, unexpected {sorted(extra)}")
        return cls(**record)


@dataclass(frozen=True)
class DatasetRef(Ref):
    """The normalised dataset (``ingest``)."""
    run_id: str
    path: str
    digest: str
    images: int
    captions: int
    rejected_images: int
    dropped_captions: int
    splits: dict[str, int] = field(default_factory=dict)
    rejects_path: str = ""

    def counts(self) -> dict[str, int]:
        return {"images": self.images, "captions": self.captions, "rejected_images": self.rejected_images,
                "dropped_captions": self.dropped_captions, **{f"split_{k}": v for k, v in self.splits.items()}}


@dataclass(frozen=True)
class FeaturesRef(Ref):
    """A region-feature store (``extract``, or ``capflow import-features``)."""
    run_id: str
    uri: str
    digest: str
    ok: int
    rejected: int
    source: str = "detector"
    report: dict[str, Any] = field(default_factory=dict)  # the extraction that produced it (counts, timings)


@dataclass(frozen=True)
class LabelsRef(Ref):
    """Vocabulary + label store aligned to a feature store's rows (``vocab``)."""
    run_id: str
    vocab_path: str
    labels_uri: str
    labels_digest: str
    vocab_digest: str
    features_uri: str | None
    features_digest: str | None
    words: int = 0
    captions: int = 0


@dataclass(frozen=True)
class TeacherRef(Ref):
    """The AIC teacher's best checkpoint (``train-teacher``)."""
    run_id: str
    checkpoint: str
    checkpoint_digest: str
    best_val_cider: float


@dataclass(frozen=True)
class SeqKDRef(Ref):
    """Teacher captions appended to the label store as source ``source`` (``seqkd``)."""
    run_id: str
    source: str
    labels_digest: str
    report: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StudentResult(Ref):
    """A trained, evaluated and registered student (``train-student``)."""
    student: str
    preset: str
    run_id: str
    metrics: dict[str, float | None]
    params: int
    latency_ms: float
    novel_fraction: float
    avg_length: float
    unique_fraction: float
    model_version: str | None
    test_set: str
    checkpoint: str  # <model folder>/model.pt
    predictions: str
    references: str
    distinct_captions: int = 0  # degenerate output shows here: few distinct captions, words repeated in a row
    repeated_token_rate: float = 0.0
    label: str = ""  # the stage's name when one student is trained several ways (SATIC's ablation)
    captions: str = "ground_truth"  # what its XE trained on: "ground_truth" | "seqkd"
    init_from_teacher: bool = False
    xe_evaluation: dict[str, Any] | None = None  # the XE weights' test metrics and summary (evaluation.xe) ...
    xe_predictions: str | None = None  # ... and their test captions (COCO results JSON)
    training: dict[str, Any] = field(default_factory=dict)  # xe / scst: best metric, best epoch, seconds, history


@dataclass(frozen=True)
class StudentFailure(Ref):
    """A student that raised: reported and left off the leaderboard, the others go on."""
    student: str
    error: str
    traceback: str = ""


@dataclass(frozen=True)
class Promotion(Ref):
    """The champion decision of a pipeline run (``promote``)."""
    changed: bool
    reason: str
    champion_version: str | None
    candidate: str | None = None
    candidate_version: str | None = None
    candidate_cider: float | None = None
    previous_version: str | None = None
    champion_cider: float | None = None  # the previous champion's test CIDEr on this run's test set
    rescored: str | None = None  # how the previous champion was scored on this run's test set, when it was


@dataclass(frozen=True)
class Row(Ref):
    """One finished student on the leaderboard."""
    student: str
    preset: str
    metrics: dict[str, float | None]
    params: int
    latency_ms: float
    unique_fraction: float
    distinct_captions: int
    repeated_token_rate: float
    run_id: str
    model_version: str | None

    @classmethod
    def of(cls, r: StudentResult) -> Row:
        return cls(student=r.student, preset=r.preset, metrics=r.metrics, params=r.params, latency_ms=r.latency_ms,
                   unique_fraction=r.unique_fraction, distinct_captions=r.distinct_captions,
                   repeated_token_rate=r.repeated_token_rate, run_id=r.run_id, model_version=r.model_version)

    @property
    def cider(self) -> float:
        return self.metrics.get("CIDEr") or 0.0


@dataclass(frozen=True)
class Baseline(Ref):
    """The most-frequent-training-caption baseline on the test split."""
    caption: str
    metrics: dict[str, float | None]


@dataclass(frozen=True)
class Leaderboard(Ref):
    """The run's students ranked (best first), the failed ones, and the baseline beside them (``leaderboard``)."""
    rows: tuple[Row, ...]
    failed: tuple[StudentFailure, ...] = ()
    baseline: Baseline | None = None

    @property
    def best(self) -> Row | None:
        return self.rows[0] if self.rows else None

    def to_record(self) -> dict[str, Any]:
        return {"leaderboard": [r.to_record() for r in self.rows],
                "failed": [{"student": f.student, "error": f.error} for f in self.failed],
                "baseline": self.baseline.to_record() if self.baseline is not None else None}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Leaderboard:
        base = record.get("baseline")
        return cls(rows=tuple(Row.from_record(r) for r in record.get("leaderboard", [])),
                   failed=tuple(StudentFailure.from_record(f) for f in record.get("failed", [])),
                   baseline=Baseline.from_record(base) if base else None)


@dataclass(frozen=True)
class RunSummary(Ref):
    """What a pipeline run did (``capflow run``'s output, the flow's result and its Prefect artifact)."""
    mlflow_run_id: str
    tracking_uri: str  # credentials masked
    experiment_id: str | None
    board: Leaderboard
    promotion: Promotion
    stages: dict[str, str]  # stage -> ran | cached | failed
    seconds: dict[str, float]  # wall time per stage in this run

    @property
    def failed(self) -> tuple[StudentFailure, ...]:
        return self.board.failed

    def to_record(self) -> dict[str, Any]:
        """The summary as JSON (``capflow run --json``, the flow's return value)."""
        p = self.promotion
        return {"mlflow_run_id": self.mlflow_run_id, "tracking_uri": self.tracking_uri,
                "experiment_id": self.experiment_id, **self.board.to_record(),
                "champion": {"version": p.champion_version, "changed": p.changed, "reason": p.reason,
                             "student": p.candidate if p.changed else None},
                "stages": dict(self.stages), "seconds": dict(self.seconds)}
