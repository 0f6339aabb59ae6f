from loader_search.cli import main

raise SystemExit(main())
