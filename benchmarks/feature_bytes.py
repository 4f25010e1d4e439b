"""Bytes per sample of an offline features shard set for each target family's real shape and drafter kind
(the table in docs/training.md, "Feature shards at scale"): ``python -m benchmarks.feature_bytes``."""

from vdtrain.data.shards import sample_bytes, sample_shapes
from vdtrain.targets.base import TargetIdentity

# (name, hidden size, image grid (rows × columns incl. end-of-row), prefix rows L, stored cond width)
FAMILIES = [
    ("LlamaGen-XL (384 px)", 1280, (24, 24), 120, 2048),
    ("Janus-Pro-7B (384 px)", 4096, (24, 24), 64, None),
    ("Lumina-mGPT / Anole 7B (512 px)", 4096, (32, 33), 64, None),
    ("Lumina-mGPT 7B (768 px)", 4096, (48, 49), 64, None),
    ("Emu3-8B (720 px)", 4096, (90, 91), 64, None),
]


def main() -> None:
    print(
        "| target (image) | rows L+N | eagle1 / medusa / block, MB | eagle3 (3 taps), MB",
        end="",
    )
    print(" | fp32 eagle1, MB | 100k samples eagle1 / eagle3, TB |")
    print("|---|---|---|---|---|---|")
    for name, hidden, grid, prefix, cond_dim in FAMILIES:
        identity = TargetIdentity("any", name, hidden, 16384, grid, prefix, "0", 32)
        fields = ["feats", "feats_mask"] + (["cond"] if cond_dim else [])
        one, four = (sample_bytes(sample_shapes(identity, fields, cond_dim, parts)) for parts in (1, 4))
        rows = prefix + grid[0] * grid[1]
        fp32 = one + rows * hidden * 2  # the fp16 states' bytes once more
        print(
            f"| {name} | {rows} | {one / 1e6:.1f} | {four / 1e6:.1f} | {fp32 / 1e6:.1f} | "
            f"{one * 1e5 / 1e12:.2f} / {four * 1e5 / 1e12:.2f} |"
        )


if __name__ == "__main__":
    main()
