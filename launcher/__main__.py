from dslaunch.launcher.main import main

if __name__ == "__main__":
    main()
