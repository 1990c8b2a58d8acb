"""``capflow ingest | extract | import-features | vocab``: the data stages alone, through the pipeline's jobs
(:mod:`tasks.data`), so they write the pipeline's workdir layout and stage records."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from flows.cli.common import CLIError, config_args, print_json, stage_context, tracking_args

log = logging.getLogger("capflow")


def cmd_ingest(args: argparse.Namespace) -> int:
    from captioning.data.karpathy import Dataset
    from tasks.data import ingest

    with stage_context(args, progress=True) as rc:
        ref = ingest(rc)
    ds = Dataset.load(ref.path)
    summary = ds.summary()
    if args.json:
        print_json({k: summary[k] for k in ("images", "captions", "splits", "rejected", "digest")}
                   | {"dropped_captions": summary["dropped_captions"], "entries": ds.entries,
                      "files_checked": ds.files_checked, "output": ref.path, "rejects": ref.rejects_path})
        return 0
    print(f"ingested {summary['images']} images, {summary['captions']} captions from {ds.source}")
    print("splits: " + ", ".join(f"{k} {v}" for k, v in summary["splits"].items()))
    print(f"rejected {len(ds.rejected)} entries, dropped {len(ds.dropped_captions)} captions "
          f"(list: {ref.rejects_path})")
    for r in ds.rejected:
        print(f"  images[{r.entry}] image_id={r.image_id} {r.file}: {r.reason}")
    print(f"dataset {ref.path}\ndigest {ds.digest}")
    return 0


def cmd_vocab(args: argparse.Namespace) -> int:
    from captioning.data.text import Vocabulary
    from tasks.data import MissingStageError, features_for, features_of_store, ingest, vocab

    with stage_context(args, progress=True) as rc:
        data = ingest(rc)
        if args.features:
            feats = features_of_store(args.features)
        else:
            try:
                feats = features_for(rc, data)
            except MissingStageError:
                feats = None  # rows in the dataset's own order; `capflow train` needs a feature store
        ref = vocab(rc, data, feats)
    v = Vocabulary.load(ref.vocab_path)
    radix = v.radix()
    info = {"vocab": ref.vocab_path, "words": len(v.words), "ids": len(v), "min_count": v.min_count,
            "radix": {"base": radix.base, "digits": radix.digits, "size": radix.size}, "labels": ref.labels_uri,
            "captions": ref.captions, "vocab_digest": ref.vocab_digest, "dataset_digest": data.digest,
            "features": ref.features_uri}
    if args.json:
        print_json(info)
    else:
        print(f"vocabulary: {info['words']} words (count >= {info['min_count']}) -> {info['vocab']}")
        print(f"radix: base {radix.base}, {radix.digits} digits per word, {radix.size} output classes")
        print(f"label store: {info['captions']} captions -> {info['labels']}"
              + (f" (rows of {ref.features_uri})" if ref.features_uri else " (dataset order: no feature store)"))
    return 0


def cmd_import_features(args: argparse.Namespace) -> int:
    from captioning.data.imports import FORMATS, FeatureImportError
    from captioning.data.stores import FeatureStore
    from tasks.data import MissingStageError, import_features

    source = Path(args.source) if args.source else None
    att = Path(args.att_dir) if args.att_dir else None
    box = Path(args.box_dir) if args.box_dir else None
    if args.npy_root:
        if source is not None:
            raise CLIError("give the source once: as SOURCE or as --npy-root")
        root = Path(args.npy_root)
        if not root.is_dir():
            raise CLIError(f"{root} is not a folder")
        source = root
    if source is None and (att is None or box is None):
        raise CLIError("give the features to import: a SOURCE file or folder (--format: "
                       f"{', '.join(FORMATS)}), or --npy-root (with cocobu_att/ and cocobu_box_relative/), or "
                       "--att-dir and --box-dir")
    if source is None:
        for d in (att, box):
            if d is not None and not d.exists():
                raise CLIError(f"{d} is not a folder")
    try:
        with stage_context(args, progress=True) as rc:
            ref = import_features(rc, att, box, source=source, fmt=args.format, boxes=args.boxes,
                                  tsv_fields=args.tsv_fields.split(",") if args.tsv_fields else None,
                                  image_sizes_files=[Path(p) for p in args.image_sizes or ()], uri=args.out,
                                  overwrite=args.overwrite)
    except (MissingStageError, FeatureImportError) as e:
        raise CLIError(str(e)) from None
    summary = FeatureStore.open(ref.uri).summary()
    if args.json:
        print_json({**summary, "store": ref.uri, "format": ref.report["format"], "records": ref.report["records"],
                    "reject_kinds": ref.report["reject_kinds"]})
    else:
        print(f"imported {summary['ok']} of {summary['images']} images ({ref.report['format']}, "
              f"{ref.report['records']} records) into {ref.uri} (boxes min {summary['boxes']['min']} mean "
              f"{summary['boxes']['mean']:.1f} max {summary['boxes']['max']}); rejected {len(summary['rejected'])}"
              + (" (" + ", ".join(f"{k}: {v}" for k, v in ref.report["reject_kinds"].items()) + ")"
                 if summary["rejected"] else ""))
        shown = summary["rejected"][:20]
        for r in shown:
            print(f"  image_id={r['image_id']}: {r['reason']}")
        if len(summary["rejected"]) > len(shown):
            print(f"  ... and {len(summary['rejected']) - len(shown)} more (all of them: --json)")
    return 0


def cmd_extract(args: argparse.Namespace) -> int:
    from captioning.data.stores import FeatureStore
    from captioning.features.naming import store_uri
    from tasks.data import extract, ingest

    with stage_context(args, progress=True) as rc:
        data = ingest(rc)
        uri = args.out or store_uri(rc.cfg)
        if not args.resume:
            _remove_store(uri)
        ref = extract(rc, data, uri=uri, workers=args.workers, reuse=False)
    if rc.cfg.features.source == "synthetic-informative":
        st = FeatureStore.open(ref.uri)
        if args.json:
            print_json({"store": st.uri, "source": "synthetic-informative", **st.summary()})
        else:
            print(f"feature store (synthetic-informative): {st.uri}, {st.num_rows} images")
        return 0
    res = ref.report
    if args.json:
        print_json(res)
        return 0
    b = res["boxes"]
    print(f"feature store: {res['store']}")
    print(f"images {res['images']}: ok {res['ok']}, rejected {len(res['rejected'])}; extracted now "
          f"{res['extracted']} ({res['skipped_chunks']} chunks already done, {res['appended']} rows added)")
    print(f"boxes per image: min {b['min']} mean {b['mean']:.1f} max {b['max']}; "
          f"{res['seconds_per_image']:.3f} s per extracted image")
    for r in res["rejected"]:
        print(f"  rejected image_id={r['image_id']}: {r['reason']}")
    for r in res["reextracted"]:
        print(f"  re-extracted chunk {r['chunk']} (rows {r['rows'][0]}..{r['rows'][1] - 1}): {r['problem']}: "
              f"{', '.join(r['files'])}")
    return 0


def _remove_store(uri: str) -> None:
    from tasks.verify import remove_store

    if remove_store(uri):
        log.warning("removed %s (--no-resume)", uri)


def add_commands(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("ingest", help="read and validate the dataset", description=(
        "Read and validate the dataset: a Karpathy-format JSON (dataset.format=karpathy, the default: "
        "dataset.annotations + dataset.images, or the synthetic dataset when no annotations are set) or "
        "WebDataset tar shards as img2dataset writes them (dataset.format=webdataset: dataset.images = the shards' "
        "folder, dataset.shards.files = their glob patterns; images stay inside the shards); write the normalised "
        "dataset and the reject list to the workdir (datasets/dataset-<digest>.parquet, "
        "datasets/rejects-<digest>.json)."))
    config_args(i)
    tracking_args(i)
    i.add_argument("--json", action="store_true", help="print a JSON summary")
    i.set_defaults(func=cmd_ingest)

    v = sub.add_parser("vocab", help="build the vocabulary and the label store", description=(
        "Build vocab.json from the train split (count >= vocab.min_count) and labels.zarr with every caption, "
        "aligned to the rows of the workdir's feature store (the one `capflow extract`, `capflow import-features` "
        "or `capflow run` recorded) or of --features."))
    config_args(v)
    tracking_args(v)
    v.add_argument("--features", metavar="URI", help="feature store whose rows the labels point at "
                   "(default: the recorded one; none: the dataset's own order)")
    v.add_argument("--json", action="store_true", help="print a JSON summary")
    v.set_defaults(func=cmd_vocab)

    f = sub.add_parser("import-features", help="import bottom-up features (npy, npz, LMDB, TSV, HDF5) into a "
                       "feature store", description=(
                           "Import region features that other tools wrote into a Zarr feature store in the "
                           "feature-store folder (features.store), recorded so that `capflow vocab` and `capflow "
                           "train` use it. Formats: npy/npz/lmdb (ruotianluo: cocobu_att/{id}.npy|.npz or "
                           "cocobu_att.lmdb, with cocobu_box_relative/ or cocobu_box/), butd-tsv (bottom-up-attention "
                           "generate_tsv.py: 6 fields, or 10 with objects and attributes), m2-hdf5 "
                           "(coco_detections.hdf5), milvlg-npz (one .npz per image); --format auto detects it from "
                           "the path. Image ids come from dataset.annotations when set (its images are the rows), "
                           "else from the source. Every malformed record is a rejected row with its reason."))
    config_args(f)
    tracking_args(f)
    f.add_argument("source", nargs="?", help="file or folder to import (a TSV file or folder of them, an HDF5 file, "
                   "a folder of MILVLG .npz files, a folder holding cocobu_att/ and cocobu_box*/)")
    f.add_argument("--format", default="auto", choices=["auto", "npy", "npz", "lmdb", "butd-tsv", "m2-hdf5",
                                                        "milvlg-npz"],
                   help="source format (default auto: from the path; an error names the candidates if it is "
                   "ambiguous)")
    f.add_argument("--npy-root", help="folder holding cocobu_att/ and cocobu_box_relative/ (same as SOURCE)")
    f.add_argument("--att-dir", help="folder (or .lmdb) of {image_id}.npy|.npz region features (N x D)")
    f.add_argument("--box-dir", help="folder (or .lmdb) of {image_id}.npy boxes (N x 4)")
    f.add_argument("--boxes", default="auto", choices=["auto", "relative", "pixels"],
                   help="npy/npz/lmdb boxes: relative (x/w, y/h) or original pixels (default auto: pixels for a "
                   "folder named cocobu_box, relative otherwise)")
    f.add_argument("--tsv-fields", metavar="NAMES", help="butd-tsv: comma-separated field order, e.g. "
                   "img_id,img_h,img_w,objects_id,objects_conf,attrs_id,attrs_conf,num_boxes,boxes,features "
                   "(default: from a header line or the field count: 6 = bottom-up, 10 = LXMERT order)")
    f.add_argument("--image-sizes", metavar="JSON", action="append",
                   help="COCO-format annotation file (images: id, width, height) giving image sizes, for pixel "
                   "boxes of sources that do not state them (m2-hdf5, cocobu_box); repeatable")
    f.add_argument("--out", metavar="URI", help="store to write (default: <features.store>/imported-<digest>.zarr)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing store")
    f.add_argument("--json", action="store_true", help="print a JSON summary")
    f.set_defaults(func=cmd_import_features)

    x = sub.add_parser("extract", help="extract region features into the feature store", description=(
        "Extract bottom-up region features (detectron2 Faster R-CNN, C4 backbone) for every dataset image into a "
        "chunked Zarr store, in parallel on Dask. Re-running resumes: finished chunks are skipped and new images "
        "are appended; other extractor settings or weights make a new store."))
    config_args(x)
    tracking_args(x)
    x.add_argument("--workers", type=int, help="Dask worker processes (default features.dask_workers; 0 = no Dask)")
    x.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="continue the store of these settings (default); --no-resume deletes it and starts over")
    x.add_argument("--out", metavar="URI", help="store URI (default: <features.store>/<settings digest>.zarr)")
    x.add_argument("--json", action="store_true", help="print a JSON summary")
    x.set_defaults(func=cmd_extract)
