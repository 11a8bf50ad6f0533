"""Figures as people read them: bytes in KiB/MiB/GiB, FLOPs, seconds.

At the bottom of the package: the planner's messages and the CLI's tables
print sizes the same way.
Docs: docs/compare.md ("What it prints").
"""


def fmt_bytes(n) -> str:
    """1234567 -> '1.18 MiB', in the largest binary unit up to YiB (1e30 -> '827,180.61
    YiB'); None -> '-'."""
    if n is None:
        return "-"
    for unit, power in (("YiB", 80), ("ZiB", 70), ("EiB", 60), ("PiB", 50), ("TiB", 40),
                        ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 2**power:
            return f"{n / 2**power:,.2f} {unit}"
    return f"{n} B"


def fmt_bytes_exact(n: int, where: str = "") -> str:
    """`fmt_bytes` and the exact count: '1.50 GiB (1,610,612,736 bytes per device)' for
    where="per device"; below 1 KiB the count alone ('96 B', never '96 B (96 bytes)')."""
    if abs(n) < 1024:
        return f"{n} B" + (f" ({where})" if where else "")
    return f"{fmt_bytes(n)} ({n:,} bytes{' ' + where if where else ''})"


def fmt_flops(f) -> str:
    """3.2e9 -> '3.2 GFLOP'; None -> '-'."""
    if f is None:
        return "-"
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= size:
            return f"{f / size:.3g} {unit}"
    return f"{f:.3g} FLOP"


def fmt_seconds(x) -> str:
    """0.0314 -> '31.4 ms'; None -> '-'."""
    if x is None:
        return "-"
    return f"{x:.3g} s" if x >= 1 else f"{x * 1e3:.3g} ms" if x >= 1e-3 else f"{x * 1e6:.3g} us"


__all__ = ["fmt_bytes", "fmt_bytes_exact", "fmt_flops", "fmt_seconds"]
