"""Region features written by other tools -> a capflow feature store (``capflow import-features``).

Formats (:data:`FORMATS`, one module each):

- ``npy`` / ``npz`` / ``lmdb`` (:mod:`.ruotianluo`): ruotianluo's ``cocobu_att`` (``<id>.npy``, ``<id>.npz`` with
  ``feat``, or an LMDB of such files' bytes) with ``cocobu_box_relative`` or ``cocobu_box`` (pixels).
- ``butd-tsv`` (:mod:`.butd_tsv`): bottom-up-attention's ``generate_tsv.py`` TSV, 6 fields or the 10-field
  LXMERT-style variant with objects and attributes.
- ``m2-hdf5`` (:mod:`.m2_hdf5`): M2 Transformer / LW-Transformer ``coco_detections.hdf5``.
- ``milvlg-npz`` (:mod:`.milvlg`): MILVLG bottom-up-attention.pytorch, one ``.npz`` per image.

The package: :mod:`.base` (the :class:`Source` interface, :class:`Regions`, :class:`Scan`, :class:`Rejected` - a
record's rejection with its kind - :class:`FeatureImportError`, the kinds, the folder scan two sources share), one
module per format, :mod:`.registry` (:data:`FORMATS`, :class:`ImportSpec`), :mod:`.detect` (:func:`resolve`:
``--format auto``) and :mod:`.importer` (the two-pass :func:`import_source`, the row plan, the checks every record
passes, :func:`read_image_sizes`). The imported store's name: :func:`captioning.features.naming.imported_uri`.

Pickles are never loaded: ``.npy``/``.npz`` files and LMDB values are read with ``allow_pickle=False`` (an LMDB
value that is not a ``.npy``/``.npz`` is a rejected row; lmdbdict's ``__...__`` entries are skipped), and MILVLG's
``info`` (a pickled object array) is never read.

Adding a format (one file and one registry line):

1. Write ``captioning/data/imports/<format>.py`` with a :class:`~.base.Source` subclass: ``format`` (its name),
   ``keyed`` (False for a source read in order: implement ``stream``, else ``load``), ``extras`` (the per-region
   store arrays it fills), ``scan`` (the first pass: every record's image id, :func:`~.base.scan_names` for a folder
   of per-image files), ``where``, ``missing``, ``describe``, ``close``. Reject a record by raising
   :class:`~.base.Rejected` with its kind (one of :mod:`.base`'s kinds) and its text; raise
   :class:`~.base.FeatureImportError` for a source that cannot be read at all. Import only :mod:`.base` (never
   this package). Add whatever detection tests ``resolve`` needs: a source file's test (``is_<format>_file(path)``),
   a folder entry's (``is_<format>_name(name)``) or the members that make a ``.npz`` file the format's.
2. Add its line to :data:`~.registry.FORMATS` in :mod:`.registry`: ``Format(name, opener, file=..., entry=...,
   npz_members=..., folder=...)`` (the opener builds the source from an :class:`ImportSpec`). ``capflow
   import-features --format`` then accepts the name, ``resolve`` detects it and :meth:`ImportSpec.open` opens it.
"""

from captioning.data.imports.base import (
    NO_ID,
    FeatureImportError,
    Regions,
    Rejected,
    Scan,
    Source,
)
from captioning.data.imports.butd_tsv import ButdTsvSource
from captioning.data.imports.detect import resolve
from captioning.data.imports.importer import REASON, ImportResult, import_source, read_image_sizes
from captioning.data.imports.m2_hdf5 import M2HDF5Source
from captioning.data.imports.milvlg import MilvlgSource
from captioning.data.imports.registry import FORMATS, Format, ImportSpec
from captioning.data.imports.ruotianluo import RuotianluoSource

__all__ = [
    "FORMATS",
    "NO_ID",
    "REASON",
    "ButdTsvSource",
    "FeatureImportError",
    "Format",
    "ImportResult",
    "ImportSpec",
    "M2HDF5Source",
    "MilvlgSource",
    "Regions",
    "Rejected",
    "RuotianluoSource",
    "Scan",
    "Source",
    "import_source",
    "read_image_sizes",
    "resolve",
]
