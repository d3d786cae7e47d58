from prefixjax.cli import main

raise SystemExit(main())
