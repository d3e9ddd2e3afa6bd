from hf_async_cb.cli import main

raise SystemExit(main())
