from mock_dynamo.cli import main

main()
