from worker.server import main

raise SystemExit(main())
