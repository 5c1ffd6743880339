from worker.server import serve

raise SystemExit(serve())
