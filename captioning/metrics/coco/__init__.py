"""COCO caption metrics (BLEU-1..4, METEOR, ROUGE-L, CIDEr, SPICE) on top of pycocoevalcap 1.2.

The numbers are those of the official coco-caption toolkit (``COCOEvalCap`` with
``params['image_id'] = cocoRes.getImgIds()``, as in its demo notebook): both sides are PTB-tokenised with the
toolkit's Stanford tokenizer (lower-case, punctuation removed), every metric runs on the tokenised text, and
only the images that have a generated caption are scored (CIDEr's document frequencies come from the references
of exactly those images). Re-scoring published model outputs with this module reproduces the published numbers.

What differs from calling ``COCOEvalCap`` directly:

* Inputs are validated first, with errors that name the file and the offending ids (:class:`EvaluationInputError`).
* Line-break characters inside a caption (``\\r``, ``\\u2028``, ...) are replaced by a space before tokenising;
  the Java tokenizer would otherwise split that caption over two lines and silently misalign every caption that
  follows. The tokenizer's output line count is checked too.
* BLEU's internal counts (``testlen``, ``reflen``, ``guess``, ``correct``, ``ratio``) are returned, not printed.
* BLEU and CIDEr are cooked a chunk of 1,000 images at a time (:mod:`.chunked`), with pycocoevalcap's own
  arithmetic and the same numbers bit for bit: memory grows with the chunk, not with the images scored (40,000
  synthetic images of 5 references: 1.5 GiB at the peak before, 229 MiB now).
* METEOR's Java process is started before tokenisation and scores in a thread while BLEU, ROUGE-L and CIDEr run,
  and is always shut down afterwards.
* SPICE never downloads anything. It runs only when a directory holding the Stanford CoreNLP 3.6.0 jars
  (``stanford-corenlp-3.6.0.jar``, ``stanford-corenlp-3.6.0-models.jar``) is configured (``spice_jars=`` /
  ``capflow evaluate --spice-jars DIR`` / environment ``CAPFLOW_SPICE_JARS``). Otherwise ``"SPICE"`` is ``None``
  (never 0) and ``"spice"`` says ``"unavailable: <reason>"``; a SPICE run that fails is reported the same way.
  SPICE runs pycocoevalcap's own ``spice-1.0.jar`` with the same input and flags as its ``Spice`` class, but with
  an explicit class path (the jars stay where they are: nothing is linked into site-packages) and two fixes
  without which spice-1.0.jar cannot finish on Java 15+ (see ``_SPICE_OPENS`` in :mod:`.spice`).

Duplicate ``image_id`` in a results file is an error naming the ids (``load_results(..., duplicates="first")``
keeps the first caption of each image instead and warns). Result ids that have no references are an error.

The package: :mod:`.inputs` (the files and their checks), :mod:`.java` (the toolkit's folders, the Java probes,
the PTB tokenizer), :mod:`.meteor` (the process's METEOR JVM), :mod:`.spice`, :mod:`.chunked` (BLEU and CIDEr in
bounded memory) and :mod:`.scoring` (:func:`score`, :func:`evaluate_files`).
"""

from __future__ import annotations

from captioning.metrics.coco.inputs import EvaluationInputError, load_references, load_results, references_document
from captioning.metrics.coco.java import ptb_tokenize
from captioning.metrics.coco.meteor import close_meteor, meteor_scorer
from captioning.metrics.coco.scoring import BLEU_METRICS, METRICS, evaluate_files, score
from captioning.metrics.coco.spice import CORENLP_JARS, SPICE_ENV, spice_status

__all__ = [
    "BLEU_METRICS", "CORENLP_JARS", "METRICS", "SPICE_ENV", "EvaluationInputError", "close_meteor", "evaluate_files",
    "load_references", "load_results", "meteor_scorer", "ptb_tokenize", "references_document", "score",
    "spice_status",
]
