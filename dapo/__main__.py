from dapo.cli import main

raise SystemExit(main())
