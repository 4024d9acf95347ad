# Finds loom's required and optional dependencies.
include(GNUInstallDirs)
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(OpenMP COMPONENTS CXX)
