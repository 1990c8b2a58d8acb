"""The papers' released checkpoints imported into capflow (the ``released`` flavours,
:func:`captioning.models.registry.released`), one module per released code base:

- :mod:`.annotated`: ruotianluo's self-critical.pytorch Annotated-Transformer captioners - ``aic``, ``satic``,
  ``zodiac`` (whose gate must be given: :func:`~.annotated.check_zodiac_gate`);
- :mod:`.relation`: jiahuei/sparse-image-captioning's relation transformer - ``ort``, ``acort``;
- :mod:`.expansionnet`: jchenghu/ExpansionNet - ``expansionnet``;
- :mod:`.lw`: luogen1996/LWTransformer on the M2-Transformer code base - ``lw``;

each with its key table beside its rules. :mod:`.common` holds what they share (reading checkpoints with
``weights_only=True``, the key-table pass, the vocabulary-row permutation, the coverage check, capflow names for
released tokens); :mod:`.codebases` the registry (:data:`CODEBASES`: code base name -> importer) and
:func:`import_checkpoint`.
"""

from captioning.models.released.annotated import ANNOTATED, ZODIAC_GATES, convert_annotated, read_words
from captioning.models.released.codebases import CODEBASES, Codebase, import_checkpoint
from captioning.models.released.common import (
    Converted,
    ImportCheckpointError,
    ImportOptions,
    build_imported,
    capflow_word,
    capflow_words,
    load_state_dict,
    permute_vocab_rows,
    read_id_words,
)
from captioning.models.released.expansionnet import convert_expansionnet
from captioning.models.released.lw import convert_lw
from captioning.models.released.relation import (
    RELATION,
    box_channel_permutation,
    convert_relation,
    read_pieces,
    released_run_config,
)

__all__ = [
    "ANNOTATED",
    "CODEBASES",
    "RELATION",
    "ZODIAC_GATES",
    "Codebase",
    "Converted",
    "ImportCheckpointError",
    "ImportOptions",
    "box_channel_permutation",
    "build_imported",
    "capflow_word",
    "capflow_words",
    "convert_annotated",
    "convert_expansionnet",
    "convert_lw",
    "convert_relation",
    "import_checkpoint",
    "load_state_dict",
    "permute_vocab_rows",
    "read_id_words",
    "read_pieces",
    "read_words",
    "released_run_config",
]
