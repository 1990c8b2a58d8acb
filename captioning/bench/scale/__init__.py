"""``capflow bench scale``: how each data-side stage's time and memory grow with the dataset, measured at several
sizes on synthetic COCO-shaped data, each stage in a fresh process.

Data (per size N, written once, not timed): ``captions_per_image`` captions per image (5 = COCO-shaped, the
default; 1 = Conceptual-Captions-shaped) whose lengths follow the Karpathy test references' length histogram and
whose words follow a Zipf-Mandelbrot law fitted to them (:data:`ZIPF`), in a Karpathy-format annotation file with
Karpathy-style splits (val and test each 5000/123,287 of the images, restval folded into train) + one tiny real
JPEG file per image, or (``input_kind`` ``shards``) in WebDataset tar shards as img2dataset writes them, ingested
with ``dataset.format=webdataset`` (val/test by a hash of the image id); a feature store of every image ingest
keeps, in image-id order (the normalised dataset's), whose regions are the embeddings of its first caption's words
plus noise (informative, at a reduced width, ``dim``). Planted faults, so that the reject paths run and the counts
can be checked: every 500th image file is empty (rejected by ingest), every 1000th caption is blank (dropped; an
image left without a caption is rejected), every 997th feature-store row is a rejected row.

Stages (:data:`STAGES`; the pipeline-side ones are added by ``tasks.bench_scale``): each runs in its own Python
process, so that peaks do not mix: the modules it needs are imported first, the process waits until the threads
they started are idle, the peak resident memory is reset (``/proc/self/clear_refs``), then the stage is timed
(``repeats``: several fresh runs; the row reports the median wall and CPU time and the largest peak memory, every
run's own numbers kept in ``runs``): its wall and CPU time, the process's peak resident memory (``VmHWM``) and the
resident memory it started from, the bytes it wrote (``write_bytes`` of ``/proc/self/io``: files, including those
it removed again) and the bytes its outputs hold on disk, plus the counts it returned (images, captions,
rejects...: the test suite checks them against the generator's).

Per stage: the growth exponents of time and of the memory above the start between the two largest sizes
(``log(y2/y1) / log(N2/N1)``: 1 = linear, 2 = quadratic), and the extrapolation to MS-COCO (123,287 images) and to
Conceptual Captions' 3.3M (as images of the run's captions per image) along them. ``quiet_check``: the cores other
processes used during each run (``/proc/stat`` minus the run's own CPU), a row marked ``noisy`` above
:data:`NOISY_CORES`. :data:`PRESETS`: ``cc3m-dry``, the data side of a CC3M dry run at 3.3M images (one size),
with a time estimate (:func:`estimate`). A stage that cannot run at a size says why in ``not_measured`` (the S3
loader above ``s3_max_images``: the moto endpoint keeps every object in memory and is not a throughput reference).

``planted-quadratic`` (not run by default) is a self-check of the fit: an O(N^2) loop whose exponent must come
out near 2.

Modules: :mod:`~captioning.bench.scale.data` (the synthetic data), :mod:`~captioning.bench.scale.stages` (the
library's stages and :data:`STAGES`), :mod:`~captioning.bench.scale.measure` (the child-process runner and the
moto endpoint), :mod:`~captioning.bench.scale.report` (exponents, extrapolation, the table),
:mod:`~captioning.bench.scale.driver` (:func:`run`, :func:`disk_table`).
"""

from captioning.bench.scale.data import (
    CAPTIONS_PER_IMAGE,
    COCO_IMAGES,
    HELD_OUT_FRACTION,
    INPUTS,
    LENGTHS,
    PLANTED,
    SHARD_SAMPLES,
    SHARD_SPLITS,
    ZIPF,
    generate,
    held_out,
    image_id,
    lexicon,
    word_probabilities,
)
from captioning.bench.scale.driver import PRESETS, disk_table, run
from captioning.bench.scale.measure import NOISY_CORES, LoadWindow, busy_cpu_seconds, child, tree_bytes
from captioning.bench.scale.report import (
    CC3M_PAIRS,
    EXTRAPOLATE_TO,
    FLAT_MEMORY_MB,
    MIN_FIT_SECONDS,
    REFERENCE,
    estimate,
    extrapolate,
    fit_stage,
    growth_exponent,
    table,
)
from captioning.bench.scale.stages import (
    STAGES,
    Stage,
    stage_cider,
    stage_coco_eval,
    stage_digests,
    stage_ingest,
    stage_loader,
    stage_names,
    stage_planted_quadratic,
    stage_region_stats,
    stage_vocab,
)

__all__ = [
    "CAPTIONS_PER_IMAGE",
    "CC3M_PAIRS",
    "COCO_IMAGES",
    "EXTRAPOLATE_TO",
    "FLAT_MEMORY_MB",
    "HELD_OUT_FRACTION",
    "INPUTS",
    "LENGTHS",
    "MIN_FIT_SECONDS",
    "NOISY_CORES",
    "PLANTED",
    "PRESETS",
    "REFERENCE",
    "SHARD_SAMPLES",
    "SHARD_SPLITS",
    "STAGES",
    "ZIPF",
    "LoadWindow",
    "Stage",
    "busy_cpu_seconds",
    "child",
    "disk_table",
    "estimate",
    "extrapolate",
    "fit_stage",
    "generate",
    "growth_exponent",
    "held_out",
    "image_id",
    "lexicon",
    "run",
    "stage_cider",
    "stage_coco_eval",
    "stage_digests",
    "stage_ingest",
    "stage_loader",
    "stage_names",
    "stage_planted_quadratic",
    "stage_region_stats",
    "stage_vocab",
    "table",
    "tree_bytes",
    "word_probabilities",
]
