"""The registry of released code bases: name (``capflow import-checkpoint --from NAME``) -> the module that reads
its checkpoint and vocabulary, and :func:`import_checkpoint`, which looks the name up.

A *code base* here is a paper's released code whose checkpoints capflow converts; it is not a student *family*
(:data:`captioning.models.names.FAMILIES`: the family a student is trained as -> its registry preset). Several
code bases can share one converter (aic/satic/zodiac: :mod:`.annotated`; ort/acort: :mod:`.relation`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from captioning.data.text import Vocabulary
from captioning.models.encoder_decoder import Captioner
from captioning.models.released.annotated import check_zodiac_gate, load_annotated
from captioning.models.released.common import (
    Converted,
    ImportCheckpointError,
    ImportOptions,
    build_imported,
    imported_vocabulary,
)
from captioning.models.released.expansionnet import load_expansionnet
from captioning.models.released.lw import load_lw
from captioning.models.released.relation import load_relation


@dataclass(frozen=True)
class Codebase:
    """How a released code base is imported: ``load(name, ckpt, vocab, options)`` reads and converts its files;
    ``step_cache``: its decoder can run the released ORT/ACORT step cache (``released_acort_cache``)."""

    load: Callable[[str, str | Path, str | Path, ImportOptions], Converted]
    step_cache: bool = False


#: released code base -> its importer, in the order ``--from`` lists them
CODEBASES: dict[str, Codebase] = {
    "aic": Codebase(load_annotated),
    "satic": Codebase(load_annotated),
    "zodiac": Codebase(load_annotated),
    "ort": Codebase(load_relation, step_cache=True),
    "acort": Codebase(load_relation, step_cache=True),
    "expansionnet": Codebase(load_expansionnet),
    "lw": Codebase(load_lw),
}


def import_checkpoint(codebase: str, path: str | Path, vocab_path: str | Path, *, heads: int = 8,
                      group_size: int | None = None, zodiac_gate: str | None = None,
                      released_acort_cache: bool = False) -> tuple[Captioner, Vocabulary]:
    """Read a released checkpoint and its vocabulary -> (capflow model, capflow Vocabulary).

    ``codebase``: a name of :data:`CODEBASES`. ``zodiac_gate``: ``sigmoid`` or ``tanh``, required for ``zodiac``
    (:func:`~captioning.models.released.annotated.check_zodiac_gate`). ``released_acort_cache`` (``ort``/``acort``):
    the model decodes with the released step cache (``ArchConfig.released_acort_cache``: the published ACORT
    captions; off = the function it was trained with). Released tokens that are not capflow words are renamed
    (:func:`~captioning.models.released.common.capflow_word`)."""
    entry = CODEBASES.get(codebase)
    if entry is None:
        raise ImportCheckpointError(f"unknown family {codebase!r}: one of {', '.join(CODEBASES)}")
    if released_acort_cache and not entry.step_cache:
        raise ImportCheckpointError(f"the released step cache is the ORT/ACORT decoder's, not {codebase}'s")
    if codebase != "zodiac":  # a gate for another code base is refused before any file is read
        check_zodiac_gate(codebase, zodiac_gate)  # zodiac's own: with its weights (convert_annotated)
    options = ImportOptions(heads=heads, group_size=group_size, zodiac_gate=zodiac_gate,
                            released_acort_cache=released_acort_cache)
    cfg, state, words = entry.load(codebase, path, vocab_path, options)
    return build_imported(cfg, state), imported_vocabulary(cfg, words)
