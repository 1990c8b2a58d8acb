"""Configuration: one pydantic model per stage, one for the whole pipeline, YAML presets.

Every setting has a default and a one-line description (``capflow config keys`` lists them). Unknown keys are
errors naming the key. Presets ship as package data (``captioning/presets/*.yaml``); a config is a preset or a
YAML file, then ``key=value`` overrides (dotted paths, values parsed as YAML scalars).
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from captioning.errors import InputError
from captioning.models.names import FAMILIES, PRESET_NAMES


class ConfigError(InputError, ValueError):
    """A configuration could not be loaded: names the file, key and what to do."""


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    # numbers given for text settings (--set run.name=2024) are taken as text
    model_config = ConfigDict(extra="forbid", validate_assignment=True, coerce_numbers_to_str=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """``run.seed=true`` is a mistake, not the number 1 (pydantic would take a boolean for an int)."""
        if isinstance(v, bool) and info.field_name is not None:
            ann = cls.model_fields[info.field_name].annotation
            if ann in (int, float, int | None, float | None):
                raise ValueError(f"expected a number, got the boolean {str(v).lower()}")
        return v


class RunConfig(Section):
    workdir: str = Field(".capflow", description="Root folder for stores, caches and artifacts of runs")

    @field_validator("workdir")
    @classmethod
    def _workdir_given(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("run.workdir is empty: give a folder (e.g. .capflow) or leave the setting out")
        if "\0" in v:
            raise ValueError("run.workdir holds a NUL byte")
        return v
    store: str | None = Field(
        None, description="Object store (s3://bucket/prefix, or a folder) holding every stage output a worker reads "
        "or writes - records, label stores, checkpoints, model folders, the feature stores unless features.store "
        "names a folder, and the images extraction workers decode: workers then need no shared filesystem, and "
        "the workdir is a local cache of it; unset: the workdir only"
    )

    @field_validator("store")
    @classmethod
    def _store_uri(cls, v: str | None) -> str | None:
        if v is None:
            return None
        v = v.strip()
        if not v or "\0" in v:
            raise ValueError("run.store is empty or holds a NUL byte: give s3://bucket/prefix or a folder, or leave "
                             "it out")
        if "://" in v and not v.startswith(("s3://", "file://")):
            raise ValueError(f"run.store {v!r}: only s3:// URIs and local folders are supported")
        if v.startswith("s3://") and not v[len("s3://"):].strip("/"):
            raise ValueError("run.store s3:// names no bucket")
        return v.rstrip("/")
    name: str = Field("capflow", min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]+$",
                      description="Name of this pipeline (MLflow experiment name; at most 200 printable characters)")
    seed: int = Field(0, description="Global random seed (data shuffling, initialisation, sampling)")
    parallel_students: int = Field(
        1, ge=1, description="Students trained at the same time (threads of one process; >1 gives up bit-for-bit "
        "reproducibility, since they share torch's random generator)"
    )
    device: str = Field("auto", description="Torch device: auto (CUDA when present), cpu, cuda, cuda:N")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Training/decoding precision on CUDA: auto (bf16 where supported, else fp32), fp32, "
        "bf16 or fp16 (autocast; fp16 with a gradient scaler; checkpoints stay fp32). CPUs always run fp32"
    )
    compile: bool | Literal["off", "default", "graphs"] = Field(
        False, description="The XE training step: off (false), default (true: torch.compile; the first steps pay "
        "the compilation) or graphs (replayed from a CUDA graph per batch shape, on CUDA in fp32/bf16; elsewhere "
        "eager)"
    )


class SyntheticConfig(Section):
    num_images: int = Field(1000, ge=1, le=100_000_000, description="Number of synthetic images to generate")
    seed: int = Field(0, description="Seed of the synthetic dataset (same seed -> identical files)")
    min_size: int = Field(96, ge=32, le=4096, description="Smallest image side in pixels")
    max_size: int = Field(192, ge=32, le=4096, description="Largest image side in pixels")
    max_objects: int = Field(4, ge=1, le=8, description="Most objects drawn in one scene")
    png_fraction: float = Field(0.3, ge=0, le=1, description="Share of images written as PNG (rest JPEG)")
    val_fraction: float = Field(0.1, ge=0, le=1, description="Share of images in the val split")
    test_fraction: float = Field(0.1, ge=0, le=1, description="Share of images in the test split")


# dataset.format=webdataset: img2dataset tar shards, read by captioning.data.shards
class ShardsConfig(Section):
    files: list[str] = Field(
        default_factory=lambda: ["*.tar"], min_length=1, description="WebDataset tar shards (dataset.format="
        "webdataset): globs relative to dataset.images, matched in name order; a shard must lie inside it")
    metadata: Literal["auto", "required", "ignore"] = Field(
        "auto", description="img2dataset's <shard>.parquet beside each tar: auto = read when present (failed "
        "downloads become rejected entries with img2dataset's error; its caption serves a sample without one), "
        "required = a shard without it is an error, ignore")
    val_images: int = Field(
        5000, ge=0, le=100_000_000, description="Images in val: the kept images ranked by a hash of their image id "
        "(the numeric img2dataset key), the first val_images go to val, the next test_images to test, the rest to "
        "train (shards carry no Karpathy split; the same images always give the same splits)")
    test_images: int = Field(5000, ge=0, le=100_000_000, description="Images in test (see val_images)")

    @field_validator("files")
    @classmethod
    def _inside_images(cls, v: list[str]) -> list[str]:
        for pat in v:
            parts = pat.replace("\\", "/").split("/")
            if not pat.strip() or "\0" in pat or pat.startswith(("/", "\\")) or ".." in parts:
                raise ValueError(f"dataset.shards.files {pat!r}: give globs relative to dataset.images, without '..'")
        return v
    max_split_fraction: float = Field(
        0.1, gt=0, le=0.45, description="val and test each hold at most this share of the kept images (at least "
        "one image each when there are three or more)")


class DatasetConfig(Section):
    annotations: str | None = Field(
        None, description="Karpathy dataset_coco.json path; unset = generate the synthetic dataset"
    )
    images: str | None = Field(None, description="Images root folder (entries' filepath/filename below it)")
    synthetic: SyntheticConfig = Field(
        default_factory=SyntheticConfig, description="Synthetic dataset used when annotations is unset"
    )
    max_reject_fraction: float = Field(
        0.01, ge=0, le=1, description="Most bad entries tolerated (rejected with reasons); more fails the run"
    )
    restval_split: Literal["train", "val", "test", "drop"] = Field(
        "train", description="Where Karpathy 'restval' images go"
    )
    max_words: int = Field(16, ge=1, le=1024, description="Captions are truncated to this many words")
    image_check: Literal["none", "header", "decode"] = Field(
        "header",
        description="Image check at ingest: none, header (+ end marker of JPEG/PNG), decode (full decode)",
    )
    hash_workers: int | None = Field(
        None, ge=1, le=1024, description="Threads checking and hashing image files at ingest; unset = the usable "
        "CPUs, at most 4 (more threads than cores only contend for the interpreter lock on small files)")
    # the input format
    format: Literal["karpathy", "webdataset"] = Field(
        "karpathy", description="Input: karpathy = dataset.annotations (Karpathy JSON) + image files below "
        "dataset.images, or the synthetic dataset when annotations is unset; webdataset = img2dataset tar shards "
        "(dataset.shards) below dataset.images, images read from the shards (never unpacked)")
    shards: ShardsConfig = Field(
        default_factory=ShardsConfig, description="The WebDataset shards and their splits (dataset.format=webdataset)")

    @model_validator(mode="after")
    def _webdataset_needs_images(self) -> DatasetConfig:
        if self.format == "webdataset":
            if not self.images:
                raise ValueError("dataset.format=webdataset reads the shards below dataset.images: set it")
            if self.annotations is not None:
                raise ValueError("dataset.annotations is a Karpathy JSON (dataset.format=karpathy); with "
                                 "dataset.format=webdataset the captions come from the shards: leave it unset")
        return self


class BottomUpOptions(Section):
    """How a bottom-up flavour departs from its reference. Every option unset = the flavour's reference value
    (the table in docs/bottom-up.md, "The pipeline, per flavour, and every deviation as an option"); each one set
    names a deviation, recorded in the store's attributes and name."""

    stem_pool: Literal["caffe", "detectron2"] | None = Field(
        None, description="Stem max-pool: caffe = k3 s2 p0 ceil (both ports), detectron2 = k3 s2 p1")
    res5_dilation: Literal[1, 2] | None = Field(
        None, description="res5 in the ROI head: 2 = stride 1, dilation 2, a 14x14 map (both ports); 1 = "
        "detectron2's stride 2, 7x7")
    pooler: Literal["ROIPool", "ROIAlignV2"] | None = Field(
        None, description="ROI pooling of the res4 map (14x14 at 1/16): ROIPool (both ports) or ROIAlignV2")
    pixel_mean: list[float] | None = Field(
        None, description="BGR pixel mean subtracted from the image; unset = the Visual Genome mean "
        "[102.9801, 115.9465, 122.7717] of both ports")
    resize: Literal["detectron2", "caffe"] | None = Field(
        None, description="detectron2 = PIL bilinear on uint8, per-axis scale, mean subtracted after (airsplay); "
        "caffe = mean subtracted first, then a float bilinear resize by one im_scale, sizes rounded half to even "
        "(MILVLG/butd)")
    proposals_rule: Literal["detectron2", "caffe"] | None = Field(
        None, description="RPN decoding and filtering: detectron2 (airsplay) or caffe = '+1' box coder, clip to "
        "w-1, minimum side before the top-k, '+1' NMS (MILVLG/butd)")
    rpn_nms_inclusive: bool | None = Field(
        None, description="caffe proposals_rule: suppress at IoU >= threshold (MILVLG's kernel) instead of >")
    rpn_min_size: float | None = Field(
        None, description="caffe proposals_rule: drop proposals whose side + 1 is not above this x im_scale "
        "(MILVLG: 16)")
    selection_iou: Literal["butd", "resized"] | None = Field(
        None, description="Per-class NMS IoU of the box selection: butd = '+1' widths on original-pixel boxes "
        "(both flavours); resized = capflow's stock rule (no +1, resized-image boxes)")
    selection_nms_inclusive: bool | None = Field(
        None, description="Selection NMS suppresses at IoU >= nms_threshold (butd's configured CPU kernel and "
        "MILVLG's: both flavours) instead of > (butd's GPU kernel)")
    conf_inclusive: bool | None = Field(
        None, description="Keep boxes whose score is >= conf_threshold (butd) instead of >")
    order: Literal["butd", "score"] | None = Field(
        None, description="Order of the kept boxes: butd = proposal order when min_boxes <= n <= max_boxes, by "
        "score when clamped; score = by score always")
    attributes: bool | None = Field(
        None, description="Store object ids/confidences and, where the checkpoint has the attribute head, "
        "attribute ids/confidences beside the features (unset: on)")


class ExtractorConfig(Section):
    flavour: Literal["stock", "airsplay", "milvlg"] = Field(
        "stock", description="stock = a detectron2 C4 model from model_config_file; airsplay / milvlg = the "
        "Visual Genome bottom-up detector exactly as that public port computes it, from the port's own weights "
        "file (layout checked)")
    bottom_up: BottomUpOptions = Field(
        default_factory=BottomUpOptions, description="Deviations from the flavour's reference (bottom-up flavours)")

    @field_validator("bottom_up")
    @classmethod
    def _bottom_up_needs_a_flavour(cls, v: BottomUpOptions, info: ValidationInfo) -> BottomUpOptions:
        if info.data.get("flavour", "stock") == "stock":
            given = sorted(k for k, val in v.model_dump().items() if val is not None)
            if given:
                raise ValueError(f"bottom_up.{', bottom_up.'.join(given)} apply to the bottom-up flavours only "
                                 "(features.extractor.flavour: airsplay or milvlg); the stock flavour ignores "
                                 "nothing silently")
        return v
    model_config_file: str = Field(
        "COCO-Detection/faster_rcnn_R_101_C4_3x.yaml",
        description="detectron2 model-zoo config (or YAML path) of the C4 Faster R-CNN",
    )
    weights: str | None = Field(None, description="Detector weights: local path or s3:// URI; unset = random")
    weights_sha256: str | None = Field(None, description="Expected sha256 of the weights file (checked)")
    min_size: int = Field(600, ge=16, le=8192, description="Short image side at inference (pixels)")
    max_size: int = Field(1000, ge=16, le=16384, description="Longest image side at inference (pixels)")
    proposals: int = Field(300, ge=1, le=100_000, description="RPN proposals kept after NMS per image")
    conf_threshold: float = Field(0.2, ge=0, le=1, description="Keep boxes whose best class score is above")
    nms_threshold: float = Field(0.3, ge=0, le=1, description="Per-class NMS IoU threshold")
    amp: bool | None = Field(
        None, description="Mixed precision inference on CUDA (autocast to amp_dtype); unset = the measured GPU "
        "default (see capflow bench extract --device cuda), never on CPU"
    )
    amp_dtype: Literal["float16", "bfloat16"] = Field("float16", description="Autocast dtype when amp is true")
    batch_size: int | None = Field(None, ge=1, le=4096,
                                   description="Images per forward pass; unset = 16 on CUDA, 2 on CPU")
    batching: Literal["auto", "exact", "padded"] = Field(
        "auto",
        description="exact: batch only images of the same resized shape, ROI head image by image (CPU results "
        "bit-identical whatever the batch); padded: mixed shapes in one zero-padded batch (aspect-ratio buckets) "
        "and one batched ROI head (features near the right/bottom edge change slightly); auto: padded on CUDA, "
        "exact on CPU",
    )
    selection_on_device: bool | None = Field(
        None, description="Run the box-selection scan on the CUDA device instead of the host (unset: host, "
        "measured faster end to end); the same boxes either way"
    )
    decode_threads: int | None = Field(
        None, ge=0, description="Threads decoding/resizing the next images while the model runs; unset = 4 on "
        "CUDA, 0 (inline) on CPU. Never changes the numbers",
    )
    decode_processes: int = Field(
        0, ge=0, description="Processes decoding/resizing the next images instead of decode_threads (threads share "
        "the extracting process's interpreter lock; off by default: no gain measured, see docs/benchmarks.md). "
        "Never changes the numbers",
    )
    channels_last: bool | None = Field(
        None, description="Run the detector's convolutions in channels-last memory format; unset = on CUDA "
        "(measured faster there), off on CPU. Float rounding only, like the device: not part of the store's name",
    )
    device: str = Field("auto", description="Extraction device: auto (CUDA when present), cpu, cuda, cuda:N")
    seed: int = Field(0, description="Seed of the random detector weights used when no weights are given")
    torch_threads: int = Field(
        1, ge=1, description="CPU threads per model (per Dask worker); CPU results are bit-identical per value"
    )
    fixed_boxes: int | None = Field(None, ge=1, le=10_000,
                                    description="Keep exactly this many boxes (e.g. 36); unset = adaptive")
    min_image_side: int = Field(16, ge=1, description="Images with a shorter side are rejected as too small")
    max_image_pixels: int = Field(
        100_000_000, ge=1, description="Images with more pixels are rejected (decompression-bomb guard)"
    )


class FeaturesConfig(Section):
    source: Literal["detector", "synthetic-informative"] = Field(
        "detector",
        description="detector: extract with detectron2; synthetic-informative: write the synthetic dataset's "
        "object attributes as region features (training checks independent of the detector)",
    )
    store: str | None = Field(None, description="Folder (path or s3://) holding the feature stores, each named by "
                               "what determines its content; unset = <workdir>/features/")
    min_boxes: int = Field(10, ge=1, le=10_000, description="Fewest boxes kept per image")
    max_boxes: int = Field(100, ge=1, le=10_000, description="Most boxes kept per image (= B_max of the store)")
    feature_dim: int = Field(2048, ge=1, le=65_536, description="Region feature width")
    dtype: Literal["float16", "float32"] = Field("float16", description="Stored feature precision")
    chunk_rows: int = Field(8, ge=1, le=1_000_000, description="Images per Zarr chunk (the unit of parallel writing)")
    max_reject_fraction: float = Field(
        0.5, ge=0, le=1, description="capflow import-features with a dataset: most of its images allowed without "
        "usable features (rejected rows); more fails the import (exit 2, the store removed)")
    compressor: Literal["none", "lz4", "zstd"] = Field(
        "lz4", description="Blosc codec for features (byte-shuffled); none = raw"
    )
    dask_workers: int = Field(2, ge=1, le=4096, description="Dask worker processes for extraction (LocalCluster)")
    dask_address: str | None = Field(None, description="Dask scheduler address; unset = LocalCluster on 127.0.0.1")
    extractor: ExtractorConfig = Field(default_factory=ExtractorConfig, description="Detector settings")


class VocabConfig(Section):
    min_count: int = Field(5, ge=1, description="Words seen fewer times in the train split become <unk>")
    radix_base: int = Field(768, ge=2, description="ACORT radix base v (digits per word follow from it)")


class LoaderConfig(Section):
    batch_size: int = Field(10, ge=1, le=1_000_000, description="Images per training batch")
    captions_per_image: int = Field(5, ge=1, le=1000, description="Captions drawn per image in a batch")
    shuffle_buffer: int = Field(256, ge=1, le=100_000_000, description="Images held in the shuffle buffer")
    dataloader_workers: int = Field(0, ge=0, description="DataLoader worker processes (0 = in the main process)")
    standardize_features: bool = Field(
        True, description="Standardise region features per dimension with the training split's statistics, stored "
        "in every trained model (the teacher's and students' ArchConfig.standardize_features)")


class ModelConfig(Section):
    arch: str = Field("aic", description="Architecture preset name from the model registry")
    d_model: int = Field(512, ge=8, le=65_536, description="Model width d")
    layers: int = Field(6, ge=1, le=1024, description="Encoder and decoder layers each")
    heads: int = Field(8, ge=1, le=1024, description="Attention heads")
    d_ff: int = Field(2048, ge=8, le=1_048_576, description="FFN hidden width")
    dropout: float = Field(0.1, ge=0, le=1, description="Dropout inside the stacks")


class XEConfig(Section):
    epochs: int = Field(15, ge=1, le=100_000, description="Cross-entropy epochs")
    noam_factor: float = Field(1.0, gt=0, description="Noam schedule factor")
    warmup: int = Field(10000, ge=1, description="Noam warm-up steps")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Label smoothing of the XE loss")
    clip: float = Field(0.1, gt=0, description="Gradient clipping by value")


class SCSTConfig(Section):
    enabled: bool = Field(True, description="Run SCST fine-tuning after XE")
    epochs: int = Field(10, ge=1, le=100_000, description="SCST epochs (a student's own: students.per_student)")
    lr: float = Field(5e-5, gt=0, description="Constant SCST learning rate")
    samples: int = Field(5, ge=2, le=1000, description="Sampled captions per image")
    baseline: Literal["mean", "greedy"] = Field("mean", description="Reward baseline: mean of others or greedy")
    batch_size: int | None = Field(None, ge=1, description="Images per SCST batch (each sampled `samples` times); "
                                   "unset = loader.batch_size")
    dropout: float | None = Field(
        0.0, ge=0, lt=1, description="Dropout at every site of the model while SCST samples and re-scores; 0 = the "
        "policy SCST improves is the one greedy/beam decoding evaluates (chosen on validation: docs/training.md, 'SCST "
        "recipe'); unset = the model's own XE dropout, as the released SCST code keeps it")


class TeacherConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="The AIC teacher's architecture")
    xe: XEConfig = Field(default_factory=XEConfig, description="Teacher XE training")
    nproc: int = Field(1, ge=1, description="Data-parallel training processes for the teacher (torch DDP: gloo on "
                       "CPU, NCCL on GPUs, one GPU per process)")


class StudentOverrides(Section):
    seqkd: bool = Field(False, description="Train on the teacher's SeqKD captions instead of the ground truth")
    teacher_init: bool = Field(False, description="Start from the teacher's weights where the shapes match")
    scst_epochs: int | None = Field(None, ge=1, le=100_000, description="SCST epochs of this student; unset = "
                                    "students.scst.epochs")


#: the per-student departures every config starts from (SATIC as its paper trains it); entries a config gives are
#: merged over these, field by field
DEFAULT_PER_STUDENT: dict[str, dict[str, Any]] = {"satic": {"seqkd": True, "teacher_init": True}}


class StudentsConfig(Section):
    names: list[str] = Field(
        default_factory=lambda: ["acort", "expansionnet", "lw", "satic", "zodiac"],
        description="Student families trained from the teacher (one run each)",
    )
    size: str = Field("base", description="Size variant of each family's registry preset")
    nproc: int = Field(1, ge=1, description="Data-parallel training processes per student (XE and SCST; torch DDP)")
    dask_workers: int = Field(0, ge=0, description="Dask worker processes that train students in parallel, one "
                              "student per worker (a LocalCluster on 127.0.0.1, at most one per GPU); 0 = in the "
                              "flow's process")
    dask_address: str | None = Field(None, description="Dask scheduler (tcp://host:port) whose workers train the "
                                     "students; unset = a LocalCluster of students.dask_workers processes")
    torch_threads: int | None = Field(None, ge=1, description="Torch threads per student process on a cluster "
                                      "(default: usable CPUs // students.dask_workers)")
    seqkd_beam: int = Field(5, ge=1, le=1000, description="Beam size of the teacher when generating SeqKD captions")
    per_student: dict[str, StudentOverrides] = Field(
        default_factory=lambda: {k: StudentOverrides(**v) for k, v in DEFAULT_PER_STUDENT.items()},
        description="How named students (a family or registry preset) depart from the common recipe: "
        "{lw: {seqkd: true}, expansionnet: {scst_epochs: 10}}; merged over the default {satic: {seqkd: true, "
        "teacher_init: true}} field by field")
    xe: XEConfig = Field(default_factory=XEConfig, description="Student XE training")
    scst: SCSTConfig = Field(default_factory=SCSTConfig, description="Student SCST fine-tuning")

    @field_validator("per_student", mode="before")
    @classmethod
    def _merged_over_defaults(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        merged: dict[str, Any] = {k: dict(e) for k, e in DEFAULT_PER_STUDENT.items()}
        for name, entry in v.items():
            if name not in FAMILIES and name not in PRESET_NAMES:
                raise ValueError(f"unknown student {name!r} (families: {', '.join(FAMILIES)})")
            if isinstance(entry, StudentOverrides):
                entry = entry.model_dump(exclude_unset=True)
            if not isinstance(entry, dict):
                return v  # pydantic names the wrong type
            merged[name] = {**merged.get(name, {}), **entry}
        return merged

    def overrides_for(self, name: str) -> StudentOverrides:
        """Student ``name``'s departures from the common recipe (none: the defaults)."""
        return self.per_student.get(name) or StudentOverrides()


class EvalConfig(Section):
    beam: int = Field(3, ge=1, le=1000, description="Beam size at evaluation")
    decoding_constraint: bool = Field(
        False, description="Never emit a word right after itself when decoding the evaluated split (the released "
        "SATIC/self-critical code's --decoding_constraint, off there by default; a radix word counts as a word)",
    )
    spice_jars: str | None = Field(None, description="Folder with Stanford CoreNLP jars for SPICE; unset = no SPICE")
    xe: bool = Field(False, description="Also evaluate each student's XE weights on the test split before SCST "
                     "(xe_test_* metrics of its run): how much SCST adds, as the learning bench reports it")


class TrackingConfig(Section):
    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; unset = MLFLOW_TRACKING_URI or a local SQLite store in workdir. "
        "No credentials here: MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)"
    )
    experiment: str | None = Field(None, description="MLflow experiment; unset = run.name")
    model_name: str = Field("capflow-captioner", description="Registered model the students are versions of")

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        from captioning.redact import has_credentials, redact

        if v is not None and has_credentials(v):
            raise ValueError(
                f"credentials in the tracking URI ({redact(v)}) are refused: a config is written to MLflow, the "
                "run's config.yaml and Prefect's database. Give the URI without them and pass the credentials "
                "through the environment: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN)"
            )
        return v


class PipelineConfig(Section):
    """The whole pipeline: one section per stage."""

    run: RunConfig = Field(default_factory=RunConfig, description="Run-wide settings")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig, description="Input dataset")
    features: FeaturesConfig = Field(default_factory=FeaturesConfig, description="Region features")
    vocab: VocabConfig = Field(default_factory=VocabConfig, description="Vocabulary and radix codec")
    loader: LoaderConfig = Field(default_factory=LoaderConfig, description="Training data loader")
    teacher: TeacherConfig = Field(default_factory=TeacherConfig, description="AIC teacher")
    students: StudentsConfig = Field(default_factory=StudentsConfig, description="Students")
    evaluation: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking")

    @field_validator("features")
    @classmethod
    def _boxes_ordered(cls, v: FeaturesConfig) -> FeaturesConfig:
        if v.min_boxes > v.max_boxes:
            raise ValueError(f"features.min_boxes ({v.min_boxes}) > features.max_boxes ({v.max_boxes})")
        return v

    # ----------------------------------------------------------------- derived paths
    @property
    def workdir(self) -> Path:
        return Path(self.run.workdir)

    def feature_store_uri(self) -> str:
        """The folder holding feature stores (``features.store``, else ``<run.store>/features``, else
        ``<workdir>/features``)."""
        from captioning.workdir import Workdir

        if self.features.store:
            return self.features.store
        if self.run.store:
            return f"{self.run.store}/features"
        return str(Workdir.of(self).default_features())

    def digest(self, section: str | None = None) -> str:
        """Stable sha256 of the whole config or of one dotted section (cache keys, lineage tags)."""
        data: Any = self.model_dump(mode="json")
        if section:
            for part in section.split("."):
                data = data[part]
        return json_digest(data)


def json_digest(data: Any) -> str:
    """sha256 of ``data``'s canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------------- loading
PRESET_PACKAGE = "captioning.presets"

#: renamed keys, old -> new: the old name is still read (with a warning) until the next release. One word, one
#: meaning: ``dask_workers`` are Dask worker processes, ``dataloader_workers`` DataLoader processes,
#: ``torch_threads`` torch's threads, ``decode_threads``/``decode_processes`` the image decoders.
RENAMED: dict[str, str] = {
    "features.workers": "features.dask_workers",
    "features.extractor.threads": "features.extractor.torch_threads",
    "features.extractor.loader_threads": "features.extractor.decode_threads",
    "features.extractor.loader_processes": "features.extractor.decode_processes",
    "loader.workers": "loader.dataloader_workers",
    "students.workers": "students.dask_workers",
    "students.threads": "students.torch_threads",
}


def _renamed_path(keys: list[str], item: str) -> list[str]:
    """An override's key path under its current name (an old name warns)."""
    for old, new in RENAMED.items():
        o = old.split(".")
        if keys[: len(o)] == o:
            _warn_renamed(f"override {item!r}", old, new)
            return new.split(".") + keys[len(o):]
    return keys


def _warn_renamed(origin: str, old: str, new: str) -> None:
    import warnings

    warnings.warn(f"{origin}: the setting {old} is now called {new}; the old name is read until the next release",
                  FutureWarning, stacklevel=4)


#: the three per-student shapes before ``students.per_student`` (lists and a mapping), read until the next release
LEGACY_PER_STUDENT = {"students.seqkd_for": "seqkd", "students.teacher_init_for": "teacher_init",
                      "students.scst.epochs_for": "scst_epochs"}


def _legacy_per_student(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """``students.seqkd_for: [..]``, ``teacher_init_for: [..]`` and ``scst.epochs_for: {..}`` as
    ``students.per_student`` entries, each with a FutureWarning. A list was the whole set: a default student it
    leaves out gets ``false``."""
    st = data.get("students")
    if not isinstance(st, dict):
        return data
    scst = st.get("scst") if isinstance(st.get("scst"), dict) else {}
    for old, field in LEGACY_PER_STUDENT.items():
        holder, key = (scst, "epochs_for") if field == "scst_epochs" else (st, old.rsplit(".", 1)[1])
        if key not in holder:
            continue
        value = holder.pop(key)
        _warn_renamed(origin, old, f"students.per_student.<name>.{field}")
        per = st.setdefault("per_student", {})
        if not isinstance(per, dict):
            raise ConfigError(f"{origin}: students.per_student must be a mapping of student names")
        if field == "scst_epochs":
            if not isinstance(value, dict):
                raise ConfigError(f"{origin}: {old} must map student names to SCST epochs, got {value!r}")
            for name, epochs in value.items():
                per.setdefault(name, {})[field] = epochs
            continue
        if not isinstance(value, list):
            raise ConfigError(f"{origin}: {old} must be a list of student names, got {value!r}")
        for name in {*DEFAULT_PER_STUDENT, *map(str, value)}:
            per.setdefault(name, {})[field] = name in value
    return data


def _renamed(data: dict[str, Any], origin: str) -> dict[str, Any]:
    """``data`` with every old key of :data:`RENAMED` moved to its new name, each with a FutureWarning; both
    names given is an error."""
    for old, new in RENAMED.items():
        *path, last = old.split(".")
        node: Any = data
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or last not in node:
            continue
        new_last = new.rsplit(".", 1)[1]  # every rename stays in its section
        if new_last in node:
            raise ConfigError(f"{origin}: {old} is the old name of {new}: give {new} only")
        node[new_last] = node.pop(last)
        _warn_renamed(origin, old, new)
    return data


def preset_names() -> list[str]:
    files = resources.files(PRESET_PACKAGE).iterdir()
    return sorted(p.name[: -len(".yaml")] for p in files if p.name.endswith(".yaml"))


def _read_yaml(text: str, origin: str) -> dict[str, Any]:
    from captioning import bounded_yaml

    try:
        data = bounded_yaml.load(text)  # aliases, expansion and nesting bounded (no alias bomb, no RecursionError)
    except bounded_yaml.YAMLLimitError as e:
        raise ConfigError(f"{origin}: {e}") from None
    except yaml.YAMLError as e:
        from captioning.redact import redact

        raise ConfigError(redact(f"{origin}: not valid YAML: {e}")) from None  # the snippet may hold a secret
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def preset_dict(name: str) -> dict[str, Any]:
    if name not in preset_names():
        raise ConfigError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    text = resources.files(PRESET_PACKAGE).joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return _read_yaml(text, f"preset {name}")


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. run.seed=3)")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key")
    from captioning import bounded_yaml

    try:
        value = bounded_yaml.load(raw) if raw.strip() else ""
    except bounded_yaml.YAMLLimitError as e:  # an alias bomb in one value is refused, not taken as text
        raise ConfigError(f"override {key}: {e}") from None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _set_path(data: dict[str, Any], path: list[str], value: Any, item: str) -> None:
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'")
        else:
            lines.append(f"'{key}': {e['msg']} (got {e.get('input')!r})")
    from captioning.redact import redact

    return redact(f"{origin}: invalid configuration:\n  " + "\n  ".join(lines))  # the input may hold a secret


def load_config(
    preset: str | None = None, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> PipelineConfig:
    """Build a config: defaults <- preset or file <- overrides. Raises ConfigError naming the key."""
    if preset and path:
        raise ConfigError("give either a preset or a config file, not both")
    origin = "defaults"
    data: dict[str, Any] = {}
    if preset:
        data, origin = preset_dict(preset), f"preset {preset}"
    elif path:
        p = Path(path)
        if p.is_dir():
            raise ConfigError(f"config file {p} is a folder: give a YAML file (capflow config show PRESET "
                              "prints one to start from)")
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}): save it as UTF-8") from None
        except OSError as e:
            raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
        data, origin = _read_yaml(text, str(p)), str(p)
    data = _renamed(data, origin)
    for item in overrides:
        keys, value = parse_override(item)
        _set_path(data, _renamed_path(keys, item), value, item)
    if overrides:
        origin += " + overrides"
    data = _legacy_per_student(data, origin)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, origin)) from None


def dump_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, default_flow_style=False)


def describe_keys(model: type[BaseModel] = PipelineConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, description) for every leaf setting."""
    rows: list[tuple[str, Any, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_keys(ann, key + "."))
        else:
            default = field.get_default(call_default_factory=True)
            rows.append((key, default, field.description or ""))
    return rows
