"""Run the agent: `python -m dpu_agent serve`."""

from dpu_agent.cli import main

raise SystemExit(main())
