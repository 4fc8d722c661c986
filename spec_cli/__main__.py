from spec_cli.cli import main

if __name__ == "__main__":  # not when a spawned -tp rank imports it as __mp_main__
    main()
