"""FID (and Inception Score) of generated images against reference statistics or images.

    python -m decay_jax.cli.fid --samples=samples.npz --ref=VIRTUAL_imagenet256_labeled.npz \
        --inception=/data/fid_inception
    python -m decay_jax.cli.fid --samples=/data/image_folder --inception=DIR --save_stats=ref.npz

``--samples`` and ``--ref``: an ``.npz`` with ``arr_0`` uint8 ``(N, H, W, 3)`` images (what
``decay_jax.cli.sample`` and ADM write), an ``.npz`` with ``mu``/``sigma`` statistics (ADM's reference
batches; pytorch-fid's ``--save-stats`` files), or a folder of images. ``--inception``: the FID
Inception converted from pytorch-fid's ``pt_inception-2015-12-05-6726825d.pth`` with
``python -m decay_jax.cli.convert_external inception``. ``--save_stats`` writes the statistics of
``--samples`` (to serve as a reference later). Features are computed sharded over this process's
devices, with progress and ETA. Prints FID, IS and counts, and writes them to ``--out`` (JSON).

The protocol is pytorch-fid's (see ``decay_jax/evals/generation.py`` for how it differs from ADM's
TensorFlow evaluator).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from decay_jax import logs, paths, validate
from decay_jax.evals import generation as gen
from decay_jax.train import checkpoint


def _stats(path: str, model, params, batch_size: int, what: str):
  """``(mu, sigma, n, logits or None)`` of a statistics file, an image ``.npz`` or a folder."""
  stats = gen.load_stats(path) if path.endswith(".npz") else None
  if stats is not None:
    return stats[0], stats[1], None, None
  images = gen.load_images(path)
  acts = gen.inception_activations(model, params, images, batch_size, what=what)
  mu, sigma = gen.statistics(acts["pool"])
  return mu, sigma, len(images), acts["logits"]


def main(argv: Optional[Sequence[str]] = None) -> int:
  p = validate.ArgumentParser(prog="python -m decay_jax.cli.fid", description=__doc__.split("\n")[0])
  p.add_argument("--samples", required=True, help="images: .npz (arr_0) or folder; or mu/sigma .npz")
  p.add_argument("--ref", help="reference: mu/sigma .npz (ADM), images .npz or folder")
  p.add_argument("--inception", help="converted FID Inception directory (convert_external)")
  p.add_argument("--save_stats", help="write mu/sigma of --samples to this .npz")
  p.add_argument("--batch_size", type=int, default=200, help="images per device batch (all devices)")
  p.add_argument("--is_split_size", type=int, default=5000, help="Inception Score split (ADM: 5000)")
  p.add_argument("--out", help="also write the results as JSON here")
  a = p.parse_args(argv)

  logs.quiet_libraries()
  try:
    if not a.ref and not a.save_stats:
      raise ValueError("give --ref (to compute FID) and/or --save_stats (to write statistics)")
    if a.batch_size < 1:
      raise ValueError(f"batch_size={a.batch_size} is not allowed; it must be >= 1")
    for field in ("samples", "ref", "inception"):
      path = getattr(a, field)
      if path and not paths.exists(path):
        raise ValueError(f"--{field}={path!r} is not allowed; no such file or folder")
    needs_net = any(x and not (x.endswith(".npz") and gen.load_stats(x) is not None)
                    for x in (a.samples, a.ref))
    model = params = None
    if needs_net:
      if not a.inception:
        raise ValueError("--inception is required to compute features of images (convert "
                         "pt_inception-2015-12-05-6726825d.pth with decay_jax.cli.convert_external)")
      model, params = checkpoint.load_params(a.inception, "inception")
      if type(model).__name__ != "FIDInceptionV3":
        raise ValueError(f"inception={a.inception!r} is not allowed; it holds a "
                         f"{type(model).__name__}, not the FID Inception")
    mu, sigma, n, logits = _stats(a.samples, model, params, a.batch_size, "samples")
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  result = {"samples": a.samples}
  if n is not None:
    result["num_samples"] = n
    result["inception_score"] = gen.inception_score(logits, a.is_split_size)
  if a.save_stats:
    gen.save_stats(a.save_stats, mu, sigma)
    print(f"wrote statistics of {a.samples} to {a.save_stats}")
  if a.ref:
    try:
      ref_mu, ref_sigma, ref_n, _ = _stats(a.ref, model, params, a.batch_size, "reference")
      result.update(ref=a.ref, fid=gen.frechet_distance(mu, sigma, ref_mu, ref_sigma))
    except ValueError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    if ref_n is not None:
      result["num_ref"] = ref_n
  print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                 for k, v in result.items()))
  if a.out:
    paths.write_json(a.out, result)
  return 0


def run():
  logs.run_command(main)


if __name__ == "__main__":
  run()
