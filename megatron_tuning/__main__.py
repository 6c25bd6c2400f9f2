"""``python -m megatron_tuning``: the command-line interface (see ``megatron_tuning.cli``)."""

from megatron_tuning.cli import main

raise SystemExit(main())
