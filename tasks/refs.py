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
