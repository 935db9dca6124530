from pipetrain.cli import main

raise SystemExit(main())
