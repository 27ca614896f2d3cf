"""Names that command lines accept and messages use, and the flags they share, in a module free
of torch: parsers built from it answer --help at once (kv/ and the engine check the same names
where they are used)."""

KV_POLICY_NAMES = ("full", "h2o", "local", "sink", "keyformer", "tova")


def tier_label(tier: str, device_type: str) -> str:
    """A tier as messages name it: where the CPU computes, the gpu tier is the compute device's
    memory (the flags keep their names)."""
    return "compute device (CPU)" if tier == "gpu" and device_type == "cpu" else tier


def duration(seconds: float) -> str:
    """A predicted duration as people say it: 40 s, 3.5 min, 2.1 h."""
    if seconds < 120:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def add_kv_flags(parser):
    """The KV policy flags every command line that runs the engine shares."""
    parser.add_argument("--kv-policy", choices=KV_POLICY_NAMES, default=None,
                        help="KV cache policy: full keeps every token (the default without --hh-ratio); the others "
                        "hold a fixed budget per sequence and head (h2o is the default with --hh-ratio)")
    parser.add_argument("--hh-ratio", type=float, default=None, metavar="R",
                        help="H2O: heavy-hitter slots = int(R * prompt_len), 0 < R <= 1; selects --kv-policy h2o")
    parser.add_argument("--recent-ratio", type=float, default=None, metavar="R",
                        help="recent-window slots = int(R * prompt_len) (default: the --hh-ratio)")
