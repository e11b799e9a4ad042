from ember.cli import main

raise SystemExit(main())
