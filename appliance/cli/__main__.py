from appliance.cli.main import main

raise SystemExit(main())
