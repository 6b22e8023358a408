from tenplex_jax.cli import main

raise SystemExit(main())
