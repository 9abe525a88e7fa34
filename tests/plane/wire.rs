// wiremock tests: being written
