from jobserver.cli import main

raise SystemExit(main())
