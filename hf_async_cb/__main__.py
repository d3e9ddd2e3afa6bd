from hf_async_cb.cli import MODULE_PROG, main

raise SystemExit(main(prog=MODULE_PROG))
