from rewardplane.cli import main

raise SystemExit(main())
