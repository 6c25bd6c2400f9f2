"""``python -m megatron_tuning``: the command-line interface (see ``megatron_tuning.commands``)."""

from megatron_tuning.commands import main

raise SystemExit(main())
