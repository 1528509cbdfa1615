"""B8: what checking every array's checksum costs a checkpoint, saved and restored.

Run: ``python bench/b08_checkpoint_checksum.py [rounds]`` (default 3) on 8 simulated CPU devices.

``save_checkpoint`` computes a checksum of every array's values (a position-weighted sum of
their bits, on the devices that hold them; ``_support.checksums``) and stores it
beside the data; ``restore_checkpoint`` recomputes it on the restored arrays and compares. The
tree is 1 GiB of float32 in 16 arrays of 64 MiB, split over ``fsdp=8`` and restored split over
``tp=8`` (another layout, as after resizing a job). Each round times, in alternating order, the
checksums alone and the whole save (which includes them), then the whole restore (which
includes them again): the ratio of the checksums' time to the call's is the share of the call
they cost. The first checksum call compiles (once per tree structure and layout) and is
reported apart. The collector stays on; the files go to a temporary directory on local disk.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from _support import checksums  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import flax_escale as fe  # noqa: E402

LEAVES, ROWS, COLS = 16, 4096, 4096  # 16 x 64 MiB of float32: 1 GiB


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    mesh = fe.create_mesh((1, 8, 1, 1, 1))
    rows, columns = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P(None, "fsdp"))
    rng = np.random.default_rng(0)
    tree = {
        f"w{i}": jax.device_put(rng.random((ROWS, COLS), dtype=np.float32), rows)
        for i in range(LEAVES)
    }
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=columns) for k, v in tree.items()}
    nbytes = sum(v.nbytes for v in tree.values())
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices, {nbytes / 2**30:.2f} GiB")
    first, _ = timed(lambda: checksums(tree))
    print(f"first checksum call (compiles): {first:.2f} s")
    sums, saves, restores, restored_sums = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt"
        fe.save_checkpoint(path, tree)
        restored = fe.restore_checkpoint(path, target)
        checksums(restored)  # compiled for the restored layout, untimed
        for r in range(rounds):
            for step in ("sums", "save") if r % 2 == 0 else ("save", "sums"):
                if step == "sums":
                    sums.append(timed(lambda: checksums(tree))[0])
                else:
                    saves.append(timed(lambda: fe.save_checkpoint(path, tree, force=True))[0])
            seconds, restored = timed(lambda: fe.restore_checkpoint(path, target))
            restores.append(seconds)
            restored_sums.append(timed(lambda r=restored: checksums(r))[0])
            del restored
    median = statistics.median
    print(f"{'':<28}{'checksums':>12}{'whole call':>12}{'share':>8}")
    for name, part, whole in (
        ("save (fsdp=8)", sums, saves),
        ("restore (into tp=8)", restored_sums, restores),
    ):
        share = median(part) / median(whole)
        print(f"{name:<28}{median(part):>11.3f}s{median(whole):>11.3f}s{share:>8.1%}")
    print(f"checksum throughput: {nbytes / 2**30 / median(sums):.2f} GiB/s on this host")


if __name__ == "__main__":
    main()
